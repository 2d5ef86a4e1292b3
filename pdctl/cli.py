"""``pdctl``: the admin CLI.

- ``make-model``: write a tiny random model.
- ``up`` / ``down``: start / stop a whole local cluster (``pdctl.launcher``) from a topology
  file or flags; ``up`` leaves a state file in the run directory that the other commands read.
- ``status``, ``nodes``, ``drain``, ``undrain``, ``route``: the proxy's admin API
  (``pdctl.admin_client``); the proxy is ``--proxy URL`` or the one ``up`` started.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cluster.config import DOWN_GRACE_S
from cluster.nodes import NodeFailure, NodeInfo, ReplicaLoad
from pdctl.admin_client import AdminClient, AdminError, AdminNode
from pdctl.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology, load_topology

if TYPE_CHECKING:  # imported lazily below: pdctl's commands start quickly
    from pdctl.launcher import RunState

app = typer.Typer(help="pdcluster admin CLI", no_args_is_help=True, add_completion=False)
console = Console()
err_console = Console(stderr=True)
T = TypeVar("T")

# Options shared by the commands that act on a running cluster.
RUN_DIR = typer.Option(None, "--run-dir", help="the run directory of `pdctl up` (default: ~/.pdcluster/CLUSTER)")
CLUSTER = typer.Option(RegistrySpec.cluster, "--cluster", help="cluster name (picks the default run directory)")
PROXY = typer.Option(None, "--proxy", help="the proxy's URL (default: the one `pdctl up` started)")
ADMIN_KEY = typer.Option(None, "--admin-key", envvar="PDCLUSTER_ADMIN_KEY", show_envvar=True,
                         help="the proxy's admin key, if it has one")
_PREFILL, _DECODE = PrefillSpec.default, DecodeSpec.default  # a node entry's defaults (for the help)


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
    preset: str | None = typer.Option(None, help="a published shape instead of the tiny one: v2-lite "
                                                 "(DeepSeek-V2-Lite) or v3 (DeepSeek-V3); needs --config-only"),
    config_only: bool = typer.Option(False, "--config-only", help="config and tokenizer, no weights (nodes "
                                                                  "then run with load_format: dummy)"),
    quantize: str | None = typer.Option(None, help="fp8: the linears in DeepSeek's block-FP8 format (e4m3, 128x128 "
                                                   "blocks, weight_scale_inv), quantized from the random weights"),
    scale_fmt: str | None = typer.Option(None, help="with --quantize fp8: ue8m0 for power-of-two scales (V3.1's)"),
    mtp_layers: int = typer.Option(0, min=0, help="multi-token prediction layers after the stack (DeepSeek-V3's "
                                                  "num_nextn_predict_layers: speculative decoding drafts with them)"),
    train: int = typer.Option(0, min=0, help="then train it this many steps on the tiny corpus (CPU, ~0.5 s a "
                                             "step), its MTP layer with it: a model whose drafts can be accepted "
                                             "(pdctl/train_tiny.py; 300 is enough to learn the corpus)"),
) -> None:
    """Write a tiny random DeepSeek-format model (config, safetensors, tokenizer, chat template), or with
    --preset and --config-only a published model's shape without weights."""
    from pdctl.tiny_model import make_tiny_model, write_config_only

    if quantize not in (None, "fp8"):
        raise typer.BadParameter("the only quantization is fp8", param_hint="--quantize")
    if scale_fmt not in (None, "ue8m0") or (scale_fmt is not None and quantize is None):
        raise typer.BadParameter("ue8m0, with --quantize fp8", param_hint="--scale-fmt")
    if preset is not None or config_only:
        from pdctl.model_presets import PRESETS, preset_config

        if preset not in PRESETS or not config_only:
            raise typer.BadParameter(f"use --preset {{{','.join(PRESETS)}}} with --config-only", param_hint="--preset")
        config = preset_config(preset, quantize, scale_fmt)
        path = write_config_only(out_dir, config)
        fp8 = "" if quantize is None else " (block FP8: dummy weights are made in FP8)"
        console.print(f"wrote the {preset} config{fp8} and a tokenizer (no weights: start nodes with load_format "
                      f"dummy) to [bold]{path}[/bold]")
        return
    if arch not in ("v2", "v3"):
        raise typer.BadParameter("arch must be v2 or v3", param_hint="--arch")
    if train and quantize is not None:
        raise typer.BadParameter("trains in float32: not with --quantize", param_hint="--train")
    path = make_tiny_model(out_dir, arch=arch, moe=moe, seed=seed, num_layers=layers, quantize=quantize,
                           scale_fmt=scale_fmt, mtp_layers=mtp_layers)
    kind = "MoE" if moe else "dense"
    fp8 = "" if quantize is None else f", block FP8{' (ue8m0 scales)' if scale_fmt else ''}"
    mtp = f", {mtp_layers} MTP layer{'s' if mtp_layers > 1 else ''}" if mtp_layers else ""
    console.print(f"wrote a tiny {arch} {kind} model ({layers} layers{mtp}, seed {seed}{fp8}) to [bold]{path}[/bold]")
    if train:
        from pdctl.train_tiny import train_tiny_model

        report = train_tiny_model(path, steps=train, seed=seed, log=True)
        mtp_loss = f", MTP loss {report.mtp_loss:.2f}" if report.mtp_loss is not None else ""
        console.print(f"trained it {report.steps} steps in {report.seconds:.0f} s: loss {report.loss:.2f}{mtp_loss}")


# --- up / down ---

@app.command()
def up(
    topology_file: Path | None = typer.Option(None, "--topology", help="a YAML topology (then no topology flags)"),
    model: Path | None = typer.Option(None, "--model", help="model directory (required without --topology)"),
    served_model_name: str | None = typer.Option(None, help="the model name clients use (default: directory name)"),
    proxy_host: str | None = typer.Option(None, help=f"proxy listen host (default: {ProxySpec.host})"),
    proxy_port: int | None = typer.Option(None, help=f"proxy port, 0 = free (default: {ProxySpec.port})"),
    prefill_nodes: int | None = typer.Option(None, min=0, help="number of prefill nodes (default: 1; 0: decode "
                                                              "nodes prefill locally, a colocated cluster)"),
    prefill_dp: int | None = typer.Option(None, min=1, help=f"DP replicas per node (default: {_PREFILL('dp')})"),
    prefill_pcp: int | None = typer.Option(None, min=1, help=f"PCP ranks per replica (default: {_PREFILL('pcp')})"),
    prefill_pp: int | None = typer.Option(None, min=1, help=f"PP stages per replica (default: {_PREFILL('pp')})"),
    kv_layout: str | None = typer.Option(None, help=f"sharded or replicated (default: {_PREFILL('kv_layout')})"),
    kv_interleave: int | None = typer.Option(None, min=1, help="sharded: tokens per run on one PCP rank"),
    prefill_tp: int | None = typer.Option(None, min=1, help="engine vllm: TP size of each prefill node (default: 1)"),
    prefill_dcp: int | None = typer.Option(None, min=1, help="engine vllm: DCP size of each prefill node (default: 1)"),
    decode_nodes: int | None = typer.Option(None, min=1, help="number of decode nodes (default: 1)"),
    decode_dp: int | None = typer.Option(None, min=1, help=f"DP ranks per decode node (default: {_DECODE('dp')})"),
    decode_tp: int | None = typer.Option(None, min=1, help="engine vllm: TP size of each decode node (default: 1)"),
    decode_dcp: int | None = typer.Option(None, min=1, help="engine vllm: DCP size of each decode node (default: 1)"),
    dtype: str | None = typer.Option(None, help=f"engine dtype of every node (default: {_PREFILL('dtype')})"),
    device: str | None = typer.Option(None, help=f"device of every node (default: {_PREFILL('device')})"),
    max_model_len: int | None = typer.Option(None, min=1, help=f"context (default: {_PREFILL('max_model_len')})"),
    load_format: str | None = typer.Option(None, help="auto, or dummy: random weights from config.json alone "
                                                      "(pdctl make-model DIR --config-only; benchmarks)"),
    gpu_memory_utilization: float | None = typer.Option(
        None, help="each node's share of its GPUs' memory (default: 0.9; two nodes sharing a GPU: 0.4 each)"),
    prefill_gpus: str | None = typer.Option(None, help="GPUs of the prefill nodes' ranks, e.g. 0,1; with several "
                                                       "nodes each takes the next equal slice"),
    decode_gpus: str | None = typer.Option(None, help="GPUs of the decode nodes' DP replicas, e.g. 1; with several "
                                                      "nodes each takes the next equal slice"),
    proxy_workers: int | None = typer.Option(None, min=0, help="proxy worker processes sharing its port (default: "
                                                               "1; 0: one per CPU core)"),
    registry_url: str | None = typer.Option(None, help="an external Redis (default: start a local redis-server)"),
    redis_port: int | None = typer.Option(None, help="the local redis-server's port (default: a free one)"),
    cluster: str | None = typer.Option(None, help=f"Redis key prefix (default: {RegistrySpec.cluster})"),
    api_key: str | None = typer.Option(None, help="the key /v1/* requires (default: none)"),
    admin_key: str | None = typer.Option(None, help="the key /admin/* requires (default: none)"),
    engine: str | None = typer.Option(None, help="native or vllm: the nodes' engine (default: native)"),
    vllm_python: str | None = typer.Option(None, help="engine vllm: the nodes' Python (default: "
                                                     "$VLLM_VENV/bin/python or /opt/vllm-venv/bin/python)"),
    run_dir: Path | None = RUN_DIR,
    timeout_s: float = typer.Option(300.0, "--timeout", help="seconds to wait for the proxy's /health"),
) -> None:
    """Start a local cluster (Redis, prefill and decode nodes, proxy); returns once it is healthy."""
    from pdctl import launcher

    flags = _TopologyFlags(
        model=model, served_model_name=served_model_name, proxy_host=proxy_host, proxy_port=proxy_port,
        prefill_nodes=prefill_nodes, prefill_dp=prefill_dp, prefill_pcp=prefill_pcp, prefill_pp=prefill_pp,
        kv_layout=kv_layout, kv_interleave=kv_interleave, prefill_tp=prefill_tp, prefill_dcp=prefill_dcp,
        decode_nodes=decode_nodes, decode_dp=decode_dp, decode_tp=decode_tp, decode_dcp=decode_dcp, dtype=dtype,
        device=device, max_model_len=max_model_len, registry_url=registry_url, redis_port=redis_port,
        cluster=cluster, api_key=api_key, admin_key=admin_key, engine=engine, vllm_python=vllm_python,
        load_format=load_format, gpu_memory_utilization=gpu_memory_utilization, prefill_gpus=prefill_gpus,
        decode_gpus=decode_gpus, proxy_workers=proxy_workers,
    )
    topology = _up_topology(topology_file, flags)
    state = _start(topology, run_dir or launcher.default_run_dir(topology.cluster), timeout_s)
    default_dir = Path(state.run_dir) == launcher.default_run_dir(state.cluster).resolve()
    console.print(f"[green]cluster {escape(state.cluster)} is up[/green]: proxy [bold]{state.proxy_url}[/bold]")
    console.print(f"  registry {state.registry_url}; logs in {Path(state.run_dir) / 'logs'}", highlight=False,
                  soft_wrap=True)
    console.print("  stop it with: pdctl down" + ("" if default_dir else f" --run-dir {state.run_dir}"),
                  highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class _TopologyFlags:
    """``pdctl up``'s topology flags (None: not given), in the order its errors name them."""

    model: Path | None
    served_model_name: str | None
    proxy_host: str | None
    proxy_port: int | None
    prefill_nodes: int | None
    prefill_dp: int | None
    prefill_pcp: int | None
    prefill_pp: int | None
    kv_layout: str | None
    kv_interleave: int | None
    prefill_tp: int | None
    prefill_dcp: int | None
    decode_nodes: int | None
    decode_dp: int | None
    decode_tp: int | None
    decode_dcp: int | None
    dtype: str | None
    device: str | None
    max_model_len: int | None
    registry_url: str | None
    redis_port: int | None
    cluster: str | None
    api_key: str | None
    admin_key: str | None
    engine: str | None
    vllm_python: str | None
    load_format: str | None
    gpu_memory_utilization: float | None
    prefill_gpus: str | None
    decode_gpus: str | None
    proxy_workers: int | None

    def given(self) -> list[str]:
        """The flags given (``--prefill-pcp``...)."""
        return ["--" + f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name) is not None]

    def topology(self) -> Topology:
        """The topology the flags describe (ValueError for a bad value, or without --model); what they leave
        out keeps its default."""
        if self.model is None:
            raise ValueError("give --model DIR (and optionally topology flags), or --topology FILE")
        placement = _given(dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
                           load_format=self.load_format, gpu_memory_utilization=self.gpu_memory_utilization)
        n_prefill = 1 if self.prefill_nodes is None else self.prefill_nodes
        n_decode = self.decode_nodes or 1
        prefill_keys = _given(dp=self.prefill_dp, pcp=self.prefill_pcp, pp=self.prefill_pp, kv_layout=self.kv_layout,
                              kv_interleave=self.kv_interleave, tp=self.prefill_tp, dcp=self.prefill_dcp)
        decode_keys = _given(dp=self.decode_dp, tp=self.decode_tp, dcp=self.decode_dcp)
        prefill = tuple(PrefillSpec(**prefill_keys, **placement, **_given(gpus=g))
                        for g in _gpu_slices(self.prefill_gpus, n_prefill, "--prefill-gpus"))
        decode = tuple(DecodeSpec(**decode_keys, **placement, **_given(gpus=g))
                       for g in _gpu_slices(self.decode_gpus, n_decode, "--decode-gpus"))
        return Topology(
            model=str(self.model), prefill=prefill, decode=decode,
            served_model_name=self.served_model_name,
            proxy=ProxySpec(**_given(host=self.proxy_host, port=self.proxy_port, api_key=self.api_key,
                                     admin_key=self.admin_key, workers=self.proxy_workers)),
            registry=RegistrySpec(**_given(url=self.registry_url, port=self.redis_port, cluster=self.cluster)),
            **_given(engine=self.engine, vllm_python=self.vllm_python),
        )


def _up_topology(topology_file: Path | None, flags: _TopologyFlags) -> Topology:
    """The cluster ``pdctl up`` starts: the topology file's, or the flags'; a bad one ends the command."""
    given = flags.given()
    try:
        if topology_file is not None:
            if given:
                _fail(f"--topology describes the whole cluster: drop {', '.join(given)} (or put them in the file)")
            return load_topology(topology_file)
        return flags.topology()
    except ValueError as e:
        _fail(str(e), code=2)


def _start(topology: Topology, run_dir: Path, timeout_s: float) -> RunState:
    """``launcher.up`` with its progress on the console; a launch that fails ends the command."""
    from pdctl import launcher

    with console.status("starting the cluster") as status:
        def progress(message: str) -> None:
            if not message.startswith("waiting"):
                console.print(f"  {message}", markup=False, highlight=False)
            status.update(message)

        try:
            return launcher.up(topology, run_dir, timeout_s=timeout_s, progress=progress)
        except launcher.LaunchError as e:
            _fail(str(e))


def _gpu_slices(gpus: str | None, nodes: int, flag: str) -> list[str | None]:
    """Each node's GPUs from one list for all ``nodes`` of a role: consecutive equal slices."""
    if gpus is None:
        return [None] * nodes
    try:
        ids = [int(g) for g in gpus.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated GPU numbers, e.g. 0,1; got {gpus!r}") from None
    if nodes == 0:
        raise ValueError(f"{flag} was given, but there are no such nodes")
    if len(ids) % nodes:
        raise ValueError(f"{flag} lists {len(ids)} GPUs for {nodes} nodes: give each node the same number")
    k = len(ids) // nodes
    return [",".join(str(g) for g in ids[i * k:(i + 1) * k]) for i in range(nodes)]


@app.command()
def down(
    run_dir: Path | None = RUN_DIR,
    cluster: str = CLUSTER,
    grace_s: float = typer.Option(DOWN_GRACE_S, "--grace", help="seconds each process may take to stop before SIGKILL"),
) -> None:
    """Stop the cluster that `pdctl up` started (idempotent)."""
    from pdctl import launcher

    if run_dir is None:  # the default run directory, else the one cluster running elsewhere (the demo's)
        found = _state(None, cluster)
        run_dir = Path(found.run_dir) if found is not None else launcher.default_run_dir(cluster)
    with console.status("stopping the cluster") as status:
        try:
            state = launcher.down(run_dir, grace_s=grace_s, progress=status.update)
        except launcher.LaunchError as e:
            _fail(str(e))
    if state is None:
        console.print(f"nothing to stop in {run_dir}", highlight=False)
    else:
        names = ", ".join(p.name for p in state.processes)
        console.print(f"[green]stopped cluster {state.cluster}[/green] ({names})", highlight=False)


# --- the proxy's admin API ---

@app.command()
def status(proxy: str | None = PROXY, admin_key: str | None = ADMIN_KEY, run_dir: Path | None = RUN_DIR,
           cluster: str = CLUSTER) -> None:
    """The cluster's nodes, their health, flags and load, as the proxy sees them."""
    url, view = _admin(proxy, admin_key, run_dir, cluster, lambda c: (c.base_url, c.view()))
    nodes = view.nodes
    table = Table(title=f"proxy {url}")
    for column in ("node", "role", "address", "DP/PCP/PP", "weights / KV, transport", "health", "drain",
                   "in flight", "queued tok / running", "KV blocks used / free"):
        table.add_column(column, no_wrap=column != "queued tok / running")
    for n in nodes:
        s, r = n.state, n.state.replicas
        table.add_row(
            # Text from the proxy is escaped: it is not rich markup.
            escape(s.info.node_id), escape(s.info.role + ("" if s.info.engine == "native" else f" ({s.info.engine})")),
            escape(s.info.address + (f"\nmetrics {s.info.metrics_address}" if s.info.metrics_address else "")),
            f"{s.info.dp}/{s.info.pcp}/{s.info.pp}" + _ep_text(s.info),
            escape(f"{s.info.weights or '?'}\n"
                   f"{s.info.kv_layout}, {s.info.kv_cache_dtype or '?'}, {s.info.kv_protocol}"),
            ("[green]healthy[/green]" if s.healthy else "[red]unhealthy[/red]")
            + ("" if n.circuit == "closed" else f" [red](circuit {n.circuit.replace('_', '-')})[/red]"),
            "[yellow]draining[/yellow]" if s.draining else "-", str(n.inflight),
            f"{sum(x.queued_prefill_tokens for x in r)} / {sum(x.running for x in r)}" + _spec_text(r),
            f"{sum(x.used_blocks for x in r)} / {sum(x.free_blocks for x in r)}",
        )
    # Not a terminal (a pipe, a log): rich would squeeze the table into 80 columns.
    Console(width=console.width if console.is_terminal else 170).print(table)
    if view.registry != "ok":
        console.print(f"[red]registry {escape(view.registry)}[/red]: {escape(view.registry_error or '')} (the proxy "
                      "routes on its last view; node health from its own probes)", highlight=False)
    for f in view.failed:
        console.print(f"[red]{escape(_failure_line(f))}[/red]", highlight=False)  # (its text is the node's)
    if not nodes:
        console.print("no nodes registered")


def _failure_line(f: NodeFailure) -> str:
    """A node that stopped serving because its engine failed, when, and why: a traceback's first and last
    lines (``--json`` has all of it)."""
    lines = [line.strip() for line in f.why.splitlines() if line.strip()]
    why = " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else f.why
    return f"{f.node_id} ({f.role}) failed {time.time() - f.at:.0f} s ago and left the cluster: {why}"


@app.command()
def nodes(proxy: str | None = PROXY, admin_key: str | None = ADMIN_KEY, run_dir: Path | None = RUN_DIR,
          cluster: str = CLUSTER, as_json: bool = typer.Option(False, "--json", help="the raw JSON")) -> None:
    """One line per node (or --json)."""
    view = _admin(proxy, admin_key, run_dir, cluster, lambda c: c.view())
    if as_json:
        typer.echo(json.dumps({"nodes": [n.raw for n in view.nodes], "failed": [f.to_dict() for f in view.failed]},
                              indent=2))
        return
    for n in view.nodes:
        typer.echo(_node_line(n))
    for f in view.failed:
        typer.echo(_failure_line(f))


@app.command()
def drain(node_id: str = typer.Argument(..., help="the node to drain"), proxy: str | None = PROXY,
          admin_key: str | None = ADMIN_KEY, run_dir: Path | None = RUN_DIR, cluster: str = CLUSTER) -> None:
    """Stop routing new requests to a node; requests in flight finish."""
    draining = _admin(proxy, admin_key, run_dir, cluster, lambda c: c.set_draining(node_id, True))
    console.print(f"{node_id}: {'draining' if draining else 'not draining'}", highlight=False)


@app.command()
def undrain(node_id: str = typer.Argument(..., help="the node to route to again"), proxy: str | None = PROXY,
            admin_key: str | None = ADMIN_KEY, run_dir: Path | None = RUN_DIR, cluster: str = CLUSTER) -> None:
    """Route new requests to a drained node again."""
    draining = _admin(proxy, admin_key, run_dir, cluster, lambda c: c.set_draining(node_id, False))
    console.print(f"{node_id}: {'draining' if draining else 'not draining'}", highlight=False)


@app.command()
def route(prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", min=1,
                                                   help="the prompt's length in tokens"),
          prompt: str | None = typer.Option(None, "--prompt", help="the prompt's text (tokenized as is, no chat "
                                            "template): the prefix caches' expected hits count too"),
          max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="output tokens it may generate"),
          proxy: str | None = PROXY, admin_key: str | None = ADMIN_KEY, run_dir: Path | None = RUN_DIR,
          cluster: str = CLUSTER) -> None:
    """Where the proxy would send a prompt of this length (or this text) now, and why."""
    if (prompt_tokens is None) == (prompt is None):
        raise typer.BadParameter("give --prompt-tokens N or --prompt TEXT (one of them)")
    chosen = _admin(proxy, admin_key, run_dir, cluster, lambda c: c.route(prompt_tokens, max_tokens, prompt))
    p, d = chosen.prefill, chosen.decode
    if prompt is not None:
        hit = max(p.cached_tokens if p is not None else 0, d.cached_tokens)
        console.print(f"prompt: {chosen.prompt_tokens} tokens, {hit} expected in a prefix cache on this route",
                      markup=False, highlight=False)
    if p is None:
        console.print("prefill: local, on the decode rank below", markup=False, highlight=False)
    else:
        console.print(f"prefill: {p.node_id} replica {p.dp_rank} (PCP {p.pcp}), cost {p.cost:g}: {p.reason}",
                      markup=False, highlight=False, soft_wrap=True)
    console.print(f"decode:  {d.node_id} rank {d.dp_rank}: {d.reason}", markup=False, highlight=False,
                  soft_wrap=True)
    if chosen.speculative:
        console.print(f"speculative decoding: {chosen.speculative}", markup=False, highlight=False, soft_wrap=True)
    if chosen.candidates:
        table = Table(title="prefill candidates")
        for column in ("node", "replica", "PCP", "cost", "eligible", "reason"):
            table.add_column(column)
        for c in chosen.candidates:
            table.add_row(escape(c.node_id), str(c.dp_rank), str(c.pcp), f"{c.cost:g}", "yes" if c.eligible else "no",
                          escape(c.reason))
        console.print(table)
    if chosen.decode_candidates:
        table = Table(title="decode candidates")
        for column in ("node", "rank", "running", "free KV blocks", "eligible", "reason"):
            table.add_column(column)
        for dc in chosen.decode_candidates:
            table.add_row(escape(dc.node_id), str(dc.dp_rank), str(dc.running), str(dc.free_blocks),
                          "yes" if dc.eligible else "no", escape(dc.reason))
        console.print(table)


def _admin(proxy: str | None, admin_key: str | None, run_dir: Path | None, cluster: str,
           call: Callable[[AdminClient], T]) -> T:
    """Run ``call`` against the proxy (``--proxy``, else the state file of `pdctl up`); errors end the command."""
    from pdctl import launcher

    if proxy is None:
        state = _state(run_dir, cluster)
        if state is None and run_dir is not None:
            _fail(f"no cluster state in {run_dir}: pass --proxy URL, or start a cluster with pdctl up")
        if state is None:
            _fail(f"no cluster state in {launcher.default_run_dir(cluster)}, and no other cluster running under "
                  "~/.pdcluster: pass --run-dir DIR or --proxy URL, or start a cluster with pdctl up")
        proxy = state.proxy_url
        if admin_key is None:  # the key of the cluster it started (else --admin-key or the environment's)
            admin_key = launcher.admin_key(Path(state.run_dir))
    client = AdminClient(proxy, admin_key)
    try:
        return call(client)
    except AdminError as e:
        _fail(str(e))
    finally:
        client.close()


def _state(run_dir: Path | None, cluster: str) -> RunState | None:
    """The state of ``--run-dir``; without one, the default run directory's, else the one cluster `pdctl
    up` started elsewhere that still runs (the demo's). Several running: the error names them."""
    from pdctl import launcher

    try:
        state = launcher.read_state(run_dir or launcher.default_run_dir(cluster))
    except launcher.LaunchError as e:
        _fail(str(e))
    if state is not None or run_dir is not None:
        return state
    running = launcher.running_clusters()
    if len(running) > 1:
        _fail("several clusters are running; pick one with --run-dir: " + ", ".join(s.run_dir for s in running))
    return running[0] if running else None


def _ep_text(info: NodeInfo) -> str:
    """Under expert parallelism a second line, "EP4, 16 experts/rank"; else nothing."""
    return f"\nEP{info.ep}, {info.experts_per_rank} experts/rank" if info.ep > 1 else ""


def _spec_text(replicas: Sequence[ReplicaLoad]) -> str:
    """Under speculative decoding a second line, "MTP: 72% accepted, 2.4 tok/step" (vLLM's acceptance rate and
    mean acceptance length, over the node's replicas' verify steps since start; "MTP on" before any); else
    nothing."""
    on = [r for r in replicas if r.spec_draft_tokens is not None]
    if not on:
        return ""
    steps = sum(r.spec_drafts or 0 for r in on)
    drafted = sum(r.spec_draft_tokens or 0 for r in on)
    accepted = sum(r.spec_accepted_tokens or 0 for r in on)
    if not drafted:  # a prefill node's (it drafts for the decode side, which verifies), or none yet
        return "\nMTP on"
    return f"\nMTP: {accepted / drafted:.0%} accepted, {1 + accepted / steps:.1f} tok/step"


def _node_line(n: AdminNode) -> str:
    s = n.state
    flags = (["healthy" if s.healthy else "UNHEALTHY"] + (["draining"] if s.draining else [])
             + ([f"circuit={n.circuit}"] if n.circuit != "closed" else []))
    ep = f" ep={s.info.ep} experts/rank={s.info.experts_per_rank}" if s.info.ep > 1 else ""
    metrics = f"  metrics={s.info.metrics_address}" if s.info.metrics_address else ""
    weights = f"  weights={s.info.weights.replace(' ', '')}" if s.info.weights else ""
    return (f"{s.info.node_id}  {s.info.role}  {s.info.address}{metrics}  "
            f"dp={s.info.dp} pcp={s.info.pcp} pp={s.info.pp}{ep}  {s.info.kv_layout}  {s.info.kv_cache_dtype or '?'}"
            f"{weights}  {' '.join(flags)}  inflight={n.inflight}")


def _given(**values: Any) -> dict[str, Any]:
    """The flags that were given: the rest keep their dataclass defaults."""
    return {k: v for k, v in values.items() if v is not None}


def _fail(message: str, code: int = 1) -> NoReturn:
    err_console.print("[red]error:[/red] ", end="")
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)  # paths stay whole
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
