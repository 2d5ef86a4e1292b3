"""``pdctl``: the admin CLI. This stage has ``make-model``; the cluster commands join it later."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="pdcluster admin CLI", no_args_is_help=True, add_completion=False)
console = Console()


@app.callback()
def main() -> None:
    """pdcluster: disaggregated prefill/decode serving for MLA models."""


@app.command("make-model")
def make_model(
    out_dir: Path = typer.Argument(..., help="directory to write the model into"),
    moe: bool = typer.Option(True, "--moe/--dense", help="MoE layers (default) or dense MLPs only"),
    seed: int = typer.Option(0, help="random seed; the same seed writes the same files"),
    arch: str = typer.Option("v2", help="v2 (DeepseekV2ForCausalLM) or v3 (DeepseekV3ForCausalLM)"),
    layers: int = typer.Option(3, min=1, help="number of decoder layers"),
) -> None:
    """Write a tiny random DeepSeek-format model (config, safetensors, tokenizer, chat template)."""
    from engine.tiny_model import make_tiny_model

    if arch not in ("v2", "v3"):
        raise typer.BadParameter("arch must be v2 or v3", param_hint="--arch")
    path = make_tiny_model(out_dir, arch=arch, moe=moe, seed=seed, num_layers=layers)
    kind = "MoE" if moe else "dense"
    console.print(f"wrote a tiny {arch} {kind} model ({layers} layers, seed {seed}) to [bold]{path}[/bold]")


if __name__ == "__main__":
    app()
