"""Draw ``docs/assets/jagg.png``, the figure of ``docs/jagg.md``.

Left: how JAGG spreads each trained step's upstream signal ``s_j`` over the two endpoint Jacobians of its group,
``(1 - alpha_j)`` onto ``J_0`` and ``alpha_j`` onto ``J_{W-1}``, on a real schedule (SD3's 10 steps, shift 3, every
step trained but the last, ``W = 4``, ``jagg_frac = 0.6``), with the weights and the routing computed by
:func:`trl_jagg.core.jagg.plan_groups`. Right: the update-stage cost model, ``3W`` forward units for exact per-step
backward against ``W + 4`` for JAGG, and the resulting speedup.

    python docs/make_jagg_figure.py [--output docs/assets/jagg.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

from trl_jagg.core.jagg import plan_groups  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "assets" / "jagg.png"


def draw(output: Path, num_steps: int = 10, group_size: int = 4, jagg_frac: float = 0.6) -> Path:
    """Render the two panels into ``output`` (PNG) and return its path."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    sigmas = scheduler.sigmas[:-1].tolist()
    trained = list(range(num_steps - 1))  # Flow-GRPO: every step but the last
    groups = plan_groups([sigmas[k] for k in trained], group_size, jagg_frac)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.35, 1]})
    for index, group in enumerate(groups):
        steps = [trained[i] for i in group.steps]
        x = np.array([sigmas[k] for k in steps])
        if group.is_joint:
            alphas = np.array(group.alphas)
            left.plot(
                x, 1 - alphas, "o-", color="tab:blue", label="weight on $J_0$: $1-\\alpha_j$" if index == 0 else None
            )
            left.plot(
                x, alphas, "s-", color="tab:orange", label="weight on $J_{W-1}$: $\\alpha_j$" if index == 0 else None
            )
            left.axvspan(x.min() - 0.015, x.max() + 0.015, color="tab:blue", alpha=0.07)
            left.text(x.mean(), 1.1, f"group {index}: JAGG\n1 backward", ha="center", fontsize=8)
        else:
            left.plot(
                x,
                np.ones_like(x),
                "^",
                color="tab:gray",
                label="exact: own $J_j$" if index == len(groups) - 1 else None,
            )
            left.axvspan(x.min() - 0.015, x.max() + 0.015, color="tab:gray", alpha=0.07)
            left.text(x.mean(), 1.1, f"group {index}: exact\n{len(steps)} backward", ha="center", fontsize=8)
    last = sigmas[-1]
    left.plot([last], [0.5], "x", color="tab:red", label="last step: not trained")
    left.set_xlim(1.03, last - 0.08)
    left.set_ylim(-0.08, 1.32)
    left.set_xlabel("flow time $\\sigma$ of the trained step (1 = noise)")
    left.set_ylabel("share of $s_j$ sent through")
    left.set_title(f"Jacobian interpolation, W = {group_size}, jagg_frac = {jagg_frac}", fontsize=10)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)

    widths = np.arange(1, 9)
    exact = 3 * widths
    jagg = np.where(widths >= 2, widths + 4, exact)  # a group of one step is routed to exact backward
    right.plot(widths, exact, "o-", color="tab:gray", label="exact: $3W$")
    right.plot(widths, jagg, "s-", color="tab:blue", label="JAGG: $W + 4$")
    right.set_xlabel("group size W (trained steps)")
    right.set_ylabel("update cost per group (forward units)")
    twin = right.twinx()
    twin.plot(widths, exact / jagg, "--", color="tab:green", label="speedup")
    twin.set_ylabel("speedup of the update stage", color="tab:green")
    for w in (4, 8):
        twin.annotate(
            f"{3 * w / (w + 4):.1f}x",
            (w, 3 * w / (w + 4)),
            textcoords="offset points",
            xytext=(-30, -2),
            color="tab:green",
        )
    right.set_title("Cost model: backward = 2 forwards", fontsize=10)
    lines = right.get_legend_handles_labels()
    twin_lines = twin.get_legend_handles_labels()
    right.legend(lines[0] + twin_lines[0], lines[1] + twin_lines[1], loc="upper left", fontsize=8)

    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw the figure of docs/jagg.md.")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    print(f"Wrote {draw(parser.parse_args().output)}")


if __name__ == "__main__":
    main()
