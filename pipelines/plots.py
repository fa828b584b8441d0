"""A training run's plots, logged to its MLflow run: ε against the ledger's releases, accuracy
against ε, and (in diagnostics mode) BAM's bias and ascent directions."""

from __future__ import annotations

import tempfile
from pathlib import Path

import dpcore


def plot_run(client, run_id: str, ledger: dpcore.PrivacyLedger) -> None:
    """ε against step (from the ledger) and accuracy against ε (from the metric history)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in ledger.entries if e.epsilon is not None]
    with tempfile.TemporaryDirectory() as tmp:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([e.index + 1 for e in entries], [e.epsilon for e in entries], marker=".")
        rolled = [e.index + 1 for e in ledger.entries if e.status != "committed"]
        if rolled:
            ax.axvspan(min(rolled), max(rolled), color="orange", alpha=0.2, label="rolled back (still counted)")
            ax.legend()
        if ledger.target_epsilon is not None:
            ax.axhline(ledger.target_epsilon, color="red", ls="--", lw=1)
            ax.text(1, ledger.target_epsilon, " budget", color="red", va="bottom")
        ax.set_xlabel("release (ledger entry)")
        ax.set_ylabel(f"ε at δ={ledger.target_delta:g} ({ledger.accountant})")
        ax.set_title("Privacy spent")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(Path(tmp) / "epsilon_vs_step.png", dpi=110)
        plt.close(fig)

        eps = {m.step: m.value for m in client.get_metric_history(run_id, "epsilon")}
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("val_accuracy", "validation"), ("test_accuracy", "test")):
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key) if m.step in eps)
            ax.plot([eps[s] for s, _ in hist], [v for _, v in hist], marker=".", label=label)
        ax.set_xlabel("ε spent")
        ax.set_ylabel("accuracy")
        ax.set_title("Accuracy against privacy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(tmp) / "accuracy_vs_epsilon.png", dpi=110)
        plt.close(fig)

        bias = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "diag_bias"))
        if bias:  # NON-PRIVATE diagnostics were asked for: draw them too (BAM Fig. 2 and App. C)
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            axes[0].plot([s for s, _ in bias], [v for _, v in bias], lw=1)
            axes[0].set(xlabel="step", ylabel="‖ĝ_clip − ĝ‖", title="Clipping bias (non-private diagnostic)")
            for key, label in (
                ("diag_magnitude_error_a", "magnitude error a"),
                ("diag_cos_per_example_ascent", "cos(g_i, ĝ), mean"),
                ("diag_cos_previous_private", "cos(previous ĝ_priv, ĝ)"),
            ):
                hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
                axes[1].plot([s for s, _ in hist], [v for _, v in hist], lw=1, label=label)
            axes[1].set(xlabel="step", title="Appendix C and ascent directions")
            axes[1].legend()
            for ax in axes:
                ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(Path(tmp) / "diagnostics.png", dpi=110)
            plt.close(fig)
        client.log_artifacts(run_id, tmp, artifact_path="plots")
