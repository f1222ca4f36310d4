"""Draw the long soak's samples: python bench/soak_plot.py soak.csv docs/soak.png

The CSV comes from KVXFERD_SOAK_SAMPLES (tests/test_soak.py). Needs matplotlib
(`pip install -e '.[plot]'`).
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    req = [int(r["request"]) for r in rows]
    generation = [r["prefill_generation"] for r in rows]
    restarts = [req[i] for i in range(1, len(rows)) if generation[i] != generation[i - 1]]
    fig, (ax_rss, ax_fds) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for side, style in (("decode", "-"), ("prefill", "--")):
        ax_rss.plot(req, [float(r[f"{side}_rss_mb"]) for r in rows], style, label=f"{side} daemon")
        ax_fds.plot(req, [int(r[f"{side}_fds"]) for r in rows], style, label=f"{side} daemon")
    for ax in (ax_rss, ax_fds):
        for x in restarts:
            ax.axvline(x, color="grey", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax_rss.set_ylabel("RSS (MB)")
    ax_fds.set_ylabel("open fds")
    ax_fds.set_xlabel("requests (dotted: prefill daemon and engine SIGKILLed and restarted)")
    seconds = float(rows[-1]["seconds"])
    ax_rss.set_title(f"kvxferd soak: {req[-1]:,} requests with faults in {seconds / 60:.0f} min")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
