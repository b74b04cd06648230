"""Peak memory (RSS) of ``examples/reward_server.py`` under its largest requests and a slow-header attack (Linux).

    python examples/reward_server_memory.py [--concurrent 8] [--trickling 256] [server flags ...]

Starts the server (``prompt_color`` reward, default limits unless flags are given) in its own process on
127.0.0.1 and reads its peak RSS (``VmHWM`` in ``/proc/<pid>/status``, reset between scenarios through
``/proc/<pid>/clear_refs``) for: one request of ``--max_request_pixels`` pixels (solid PNGs: a few hundred KB sent,
the whole limit decoded), ``--concurrent`` such requests at once (bounded by ``--max_decoded_pixels``), and
``--trickling`` connections holding incomplete headers while a real request is served.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from PIL import Image

from trl_jagg.rewards import remote
from trl_jagg.rewards.server_limits import MAX_PIXELS

SERVER = Path(__file__).resolve().parent / "reward_server.py"


def status_mb(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--trickling", type=int, default=256)
    args, server_flags = parser.parse_known_args()
    flags = dict(zip(server_flags[::2], server_flags[1::2]))
    max_pixels = int(flags.get("--max_pixels", MAX_PIXELS))
    request_pixels = int(flags.get("--max_request_pixels", 2 * MAX_PIXELS))
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--rewards", "prompt_color", "--port", "0", *server_flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(200):
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/score", process.stderr.readline())
            if found:
                break
        threading.Thread(target=process.stderr.read, daemon=True).start()  # drain the access log
        url = found.group(1)
        reward = remote(f"{url}/score/prompt_color", timeout=120, retries=0)
        side = int(max_pixels**0.5)
        images = [Image.new("RGB", (side, side), (255, 0, 0))] * max(1, request_pixels // (side * side))
        reward(["red"], [Image.new("RGB", (64, 64))])  # warm up: imports and first allocations
        baseline = status_mb(process.pid, "VmRSS")
        print(f"baseline RSS: {baseline:.0f} MB")

        reset_peak(process.pid)
        reward(["red"] * len(images), images)
        print(f"one request of {len(images)} x {side}x{side} px: peak {status_mb(process.pid, 'VmHWM'):.0f} MB")

        reset_peak(process.pid)
        threads = [
            threading.Thread(target=reward, args=(["red"] * len(images), images)) for _ in range(args.concurrent)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(f"{args.concurrent} such requests at once: peak {status_mb(process.pid, 'VmHWM'):.0f} MB")

        reset_peak(process.pid)
        before = status_mb(process.pid, "VmRSS")
        port = int(url.rsplit(":", 1)[1])
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.trickling)]
        for sock in slow:
            sock.sendall(b"POST /score/prompt_color HTTP/1.1\r\nX-Slow: ")
        start = time.monotonic()
        reward(["red"], [Image.new("RGB", (512, 512), (255, 0, 0))])
        served = time.monotonic() - start
        for sock in slow:
            sock.close()
        print(
            f"{args.trickling} connections trickling headers: a real request served in {served:.2f} s, "
            f"peak {status_mb(process.pid, 'VmHWM'):.0f} MB (from {before:.0f} MB)"
        )
    finally:
        process.kill()
        process.wait(10)


if __name__ == "__main__":
    main()
