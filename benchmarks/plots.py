"""The benchmark's plots (matplotlib, imported when a plot is asked for): held-out loss against
wall time and samples per mode (titled with the protocol and its global batch), and the compute
and comm phases of a few steps per worker."""

from __future__ import annotations

from benchmarks.modes import MODES


def plot_loss(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 5))
    for i, o in enumerate(rows):
        color = f"C{i % 10}"
        for k, ev in enumerate(o["evals"]):
            pts = [e for e in ev if e["loss"] is not None]
            label = f"{o['mode']} (lr {o['lr']:g})" if k == 0 else None
            ls = "--" if o["kind"] == "torch-ddp" else "-"
            ax_t.plot([e["time_s"] for e in pts], [e["loss"] for e in pts], ls, marker="o", ms=3,
                      color=color, label=label)
            ax_s.plot([e["samples"] for e in pts], [e["loss"] for e in pts], ls, marker="o", ms=3, color=color)
    target = next((o["target_loss"] for o in rows if o["target_loss"] is not None), None)
    for ax in (ax_t, ax_s):
        if target is not None:
            ax.axhline(target, color="k", lw=0.8, ls=":")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("wall time (s)")
    ax_s.set_xlabel("global samples")
    ax_t.legend(fontsize=7)
    ax_t.set_title("held-out loss against wall time")
    ax_s.set_title("held-out loss against samples")
    first = rows[0] if rows else {}
    if first.get("protocol") == "matched":
        fig.suptitle(f"matched batch: {first.get('global_batch')} samples per optimizer step for every mode, "
                     f"{first.get('workers')} workers, {first.get('rate')}", fontsize=10)
    elif first.get("rate"):
        fig.suptitle(f"free batch (each mode at the batch it likes), {first.get('workers')} workers, "
                     f"{first.get('rate')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PHASE_COLORS = {"compute": "#4C72B0", "compute+allreduce": "#8172B2", "reduce_scatter": "#DD8452",
                "optimizer": "#55A868", "all_gather": "#C44E52"}


def plot_timeline(runs: list[dict], modes: list[str], path: str, n_steps: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    picked = []
    for m in modes:  # first run of each mode (lowest seed, first lr run)
        rs = [r for r in runs if r["mode"] == m and r.get("timeline")]  # merged runs carry none
        if rs:
            picked.append(min(rs, key=lambda r: r["seed"]))
    if not picked:
        return
    fig, axes = plt.subplots(len(picked), 1, figsize=(13, 1.3 + 1.0 * len(picked) * 1.6), squeeze=False)
    for ax, r in zip(axes[:, 0], picked):
        ends, acc = [], 0.0
        for h in r["history"]:
            acc += h["time_s"]
            ends.append(acc)
        start = ends[0] if len(ends) > n_steps + 1 else 0.0  # skip the first step (warm-up)
        stop_i = min(len(ends) - 1, (1 if start else 0) + n_steps)
        stop = ends[stop_i] if ends else max(t[3] for t in r["timeline"])
        workers = sorted({t[1] for t in r["timeline"]})
        for ph, rank, a, b, _ in r["timeline"]:
            if b < start or a > stop:
                continue
            comm = ph in ("reduce_scatter", "optimizer", "all_gather") and MODES[r["mode"]].kind == "engine"
            y = rank * 2 + (0 if comm else 1)
            ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), facecolor=PHASE_COLORS.get(ph, "grey"),
                           edgecolor="white", linewidth=0.4)
        ax.set_xlim(start, stop)
        ax.set_yticks([w * 2 + k for w in workers for k in (0, 1)])
        ax.set_yticklabels([f"w{w} {'comm' if k == 0 else 'compute'}" for w in workers for k in (0, 1)], fontsize=7)
        ddp = MODES[r["mode"]].kind == "torch-ddp"
        note = " (DDP: the all-reduce runs inside the synchronised backward)" if ddp else ""
        ax.set_title(f"{r['mode']} (seed {r['seed']}, lr {r['lr']:g}): steps "
                     f"{(2 if start else 1)}-{stop_i + 1}{note}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("wall time since start (s)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in PHASE_COLORS.items()], loc="upper right",
               fontsize=7, ncol=5)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


