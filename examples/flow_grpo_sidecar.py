"""Serve Flow-GRPO's reward-server scorers (GenEval, DeQA) over trl_jagg's JSON remote-reward protocol.

Flow-GRPO's sidecar (github.com/yifan123/reward-server, `app_geneval.py` / `app_deqa.py`) receives and answers
Python pickles: unpickling an answer runs whatever code the sender put in it. This adapter never sends or reads a
pickle. It runs in the sidecar's own environment (GenEval's mmdet and Mask2Former need Python 3.10 and torch 2.1),
imports the sidecar's scoring functions in process (`reward_server/gen_eval.py: load_geneval`,
`reward_server/deqa.py: load_deqascore`, loaded by file under other names, so that the sidecar's `reward_server`
package clashes with nothing) and serves them with trl_jagg's reward server (`trl_jagg.rewards.server`, Starlette
on uvicorn: the limits, token and checks of `examples/reward_server.py`):

    cd reward-server                      # the sidecar's checkout: gen_eval.py reads reward_server/object_names.txt
    pip install --no-deps -e /path/to/trl_jagg   # trl_jagg.rewards imports only torch, numpy and Pillow
    pip install starlette uvicorn                # the server's stack (see below)
    python /path/to/trl_jagg/examples/flow_grpo_sidecar.py --scorers geneval deqa --port 18085

and train with `reward_funcs=["http://127.0.0.1:18085/score/geneval"]` on GenEval's prompts
(`dataset/geneval/train_metadata.jsonl` in Flow-GRPO: the `tag`, `include` and, where present, `exclude` columns
travel as metadata). The GenEval reward is the sidecar's `scores` with `only_strict=True`, what Flow-GRPO trains on;
DeQA's is its `score / 5`. Flow-GRPO's client sends JPEG (quality 75); the remote reward sends lossless PNG. The
server is tested with starlette 1.10 and uvicorn 0.55, which need Python 3.11; on Python 3.10 pip picks their last
releases for it, which this adapter has not been tested with.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from PIL import Image

try:
    from trl_jagg.rewards.server import Limits, build_server
except ModuleNotFoundError as missing:  # the server's stack is not installed: one line, not a traceback
    sys.exit(f"flow_grpo_sidecar.py: {missing}")
from trl_jagg.rewards.remote import TOKEN_ENV


def load_file(name: str, path: Path) -> ModuleType:
    """The module at ``path``, imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not path.is_file():
        raise FileNotFoundError(f"{path} not found: run from the reward-server checkout or pass --sidecar_dir.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class SidecarScorer:
    """A trl_jagg reward over one of the sidecar's scoring functions, built on the first call (loading Mask2Former
    or DeQA takes minutes); ``per_sample``: each image is scored on its own."""

    per_sample = True

    def __init__(self, name: str, load: Callable[[], Callable[..., Any]]):
        self.__name__ = name
        self._load, self._score, self._lock = load, None, threading.Lock()

    def scorer(self) -> Callable[..., Any]:
        with self._lock:
            if self._score is None:
                self._score = self._load()
            return self._score


class GenEval(SidecarScorer):
    def __call__(
        self,
        prompts: Sequence[str],
        images: Sequence[Image.Image],
        tag: Sequence[str] | None = None,
        include: Sequence[list] | None = None,
        exclude: Sequence[list | None] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        if tag is None or include is None:
            raise ValueError(
                "GenEval needs each prompt's metadata: dataset columns 'tag' and 'include' (and 'exclude' where "
                "GenEval has one), as in GenEval's metadata .jsonl files."
            )
        metadatas = []
        for i, prompt in enumerate(prompts):
            metadata = {"tag": tag[i], "include": include[i], "prompt": prompt}
            if exclude is not None and exclude[i] is not None:
                metadata["exclude"] = exclude[i]
            metadatas.append(metadata)
        scores, *_ = self.scorer()([image.convert("RGB") for image in images], metadatas, True)
        return [float(score) for score in scores]


class DeQA(SidecarScorer):
    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        return [float(score) for score in self.scorer()([image.convert("RGB") for image in images])]


def sidecar_rewards(names: Sequence[str], sidecar_dir: Path) -> dict[str, SidecarScorer]:
    """The rewards named in ``names`` (``geneval``, ``deqa``) over the sidecar checkout at ``sidecar_dir``."""
    builders = {
        "geneval": lambda: GenEval(
            "geneval",
            lambda: load_file("flow_grpo_gen_eval", sidecar_dir / "reward_server" / "gen_eval.py").load_geneval(),
        ),
        "deqa": lambda: DeQA(
            "deqa", lambda: load_file("flow_grpo_deqa", sidecar_dir / "reward_server" / "deqa.py").load_deqascore()
        ),
    }
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise ValueError(f"Unknown sidecar scorer(s) {unknown}; use {sorted(builders)}.")
    return {name: builders[name]() for name in names}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scorers", nargs="+", default=["geneval"], help="geneval and/or deqa")
    parser.add_argument("--sidecar_dir", default=os.getcwd(), help="the reward-server checkout (default: here)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18085)
    parser.add_argument("--token", default=None, help="shared token (default: $TRL_JAGG_REWARD_TOKEN)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    rewards = sidecar_rewards(args.scorers, Path(args.sidecar_dir))
    token = args.token or os.environ.get(TOKEN_ENV) or None
    server = build_server(rewards, args.host, args.port, Limits(token=token))
    logging.info("Serving %s on http://%s:%d/score/<name>", ", ".join(rewards), *server.server_address)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn stops on the signal, then raises it again
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
