"""The planner's commands of `libra`: `libra plan` (the preflight search), `libra plan explain`
(a running planner's decisions) and `libra sim` (the cluster simulator, of flags or of the design a
run config describes). They change when the planner's inputs or the simulator's options do;
libra/cli.py wires them into the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys

from libra.cli_config import client, load
from libra.errors import ConfigError, FailedPrecondition


def cmd_plan(args: argparse.Namespace) -> int:
    from libra.errors import InvalidArgument
    from libra.services.planner.hardware import load_gpu, load_model
    from libra.services.planner.preflight import load_batch_specs, preflight
    from libra.traces.spec import pairs

    missing = [f"--{name}" for name in ("cluster", "model", "trace", "gpus") if getattr(args, name) is None]
    if missing:
        raise ConfigError(f"libra plan needs {', '.join(missing)} (or `libra plan explain --config FILE`)")
    if args.simulate and not 0 <= args.staleness <= 64:  # before any search: a bad flag fails at once
        raise ConfigError(f"--staleness must be in 0..64 (the staleness bound of the run), got {args.staleness}")
    if args.simulate:
        _check_sim_workers(args.sim_workers)
    options = {"group_size": args.group_size, "whole_nodes": args.whole_nodes}
    for name in ("tp_choices", "pp_choices", "min_train_gpus", "min_rollout_gpus"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    try:
        batch, note = load_batch_specs(args.trace, args.batch, args.group_size)
        trace = pairs(batch)
        model, gpu = load_model(args.model), load_gpu(args.cluster)
        decision = preflight(model, gpu, trace, args.gpus, args.top_k, options)
        first = _simulated(args, model, gpu, batch, options) if args.simulate else None
    except InvalidArgument as error:
        raise ConfigError(str(error)) from None
    if first is None:
        print(f"chosen: {decision.candidates[0].note}")
        print(f"trace:  {note}")
        print(f"why:    {decision.reason}")
        for rank, candidate in enumerate(decision.candidates[1:], start=2):
            print(f"  #{rank}: {candidate.note}")
        chosen = decision.chosen
    else:
        import time

        from libra.services.planner.preflight import to_plan

        print(f"chosen: {first.chosen.describe()}")
        print(f"trace:  {note}")
        print(f"why:    {first.reason}")
        print(f"simulated ({len(first.ranked)} plans in {first.workers} process{'es' if first.workers > 1 else ''}; "
              f"staleness {args.staleness}, {args.policy} routing; seconds per step in the pipeline once filled):")
        for rank, (candidate, per_step) in enumerate(first.ranked, start=1):
            mark = "  (the closed form's best)" if candidate == first.searched else ""
            print(f"  #{rank}: {per_step:8.1f}s  {candidate.describe()}{mark}")
        chosen = to_plan(first.chosen, trace, time.time())
    buckets = ", ".join(f"{b.name} (tp{b.tp} x{b.replicas}, <= {b.max_tokens} tokens)" for b in chosen.buckets)
    print(f"rollout buckets: {buckets}")
    return 0


def _simulated(args: argparse.Namespace, model, gpu, batch, options: dict):
    """`libra plan --simulate`: the preflight's shortlist ranked on the cluster simulator, as a
    run's first plan is (services/planner/sim/rank.first_plan)."""
    from libra.services.planner.config import ReplanSettings
    from libra.services.planner.preflight import search_config
    from libra.services.planner.sim.cluster import SimConfig
    from libra.services.planner.sim.rank import first_plan

    config = search_config(args.gpus, args.top_k, options)
    sim = SimConfig(staleness=args.staleness, policy=args.policy, batching="in_order")
    return first_plan(model, gpu, config, sim, batch, ReplanSettings(sim_workers=args.sim_workers),
                      notes=lambda line: print(line, file=sys.stderr, flush=True))


def _check_sim_workers(value: int) -> None:
    """--sim-workers of `libra plan --simulate` and `libra sim`, refused before any work."""
    if not 0 <= value <= 256:
        raise ConfigError(f"--sim-workers must be in 0..256 (processes replaying plans side by side; 0: one per "
                          f"core, at most 16), got {value}")


def degrees(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4) for --tp / --pp."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4,8, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one degree, e.g. 1,2,4,8")
    return values


def cmd_plan_explain(args: argparse.Namespace) -> int:
    """The planner's recent decisions and calibration (the Explain RPC of a running planner)."""
    import asyncio

    import grpc

    from libra.rpc import channel
    from libra.services.planner.core import render_explain as render
    from libra.v1 import planner_pb2, planner_pb2_grpc

    config = client(args)

    async def call():
        async with channel(config.address_of("planner")) as chan:
            return await planner_pb2_grpc.PlannerStub(chan).Explain(
                planner_pb2.ExplainRequest(run_id=config.run_id, limit=args.limit), timeout=10)
    try:
        reply = asyncio.run(call())
    except grpc.aio.AioRpcError as error:
        raise FailedPrecondition(f"planner at {config.address_of('planner')} did not answer Explain: "
                                 f"{error.code().name} {error.details()}; is it running (libra up / libra serve "
                                 f"planner)?") from None
    if args.json:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(reply))
    else:
        print(render(reply))
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    """Discrete-event simulation of the whole loop at cluster scale (services/planner/sim/); with
    --config, of the design that run config describes (services/planner/sim/design.py)."""
    from libra.errors import InvalidArgument
    from libra.services.planner.hardware import load_gpu, load_model
    from libra.services.planner.sim import design as sim_design, run as sim_run
    from libra.services.planner.config import ReplanSettings
    from libra.services.planner.sim.checkpoint import Stopped
    from libra.services.planner.sim.cluster import SimConfig

    design = None
    if args.sim_workers is not None:
        _check_sim_workers(args.sim_workers)
    if args.config:
        flags = ("cluster", "model", "gpus", "policy", "planner", "staleness", "group_size")
        given = [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} with --config: the run config sets them (planner.cluster, "
                              "scheduler.policy, planner.mode, trainer.max_staleness, trainer.group_size); "
                              "override them with --set KEY=VALUE")
        design = sim_design.design_of(load(args), args.max_workers)
        if args.sim_workers is not None:
            design = dataclasses.replace(design, replan=design.replan.model_copy(update={"sim_workers": args.sim_workers}))
        model, gpu, gpus, group_size = design.model, design.gpu, design.search.total_gpus, design.search.group_size
        label = design.name
    elif not (args.cluster and args.model and args.gpus):
        raise ConfigError("libra sim needs --cluster, --model and --gpus, or --config FILE (a run config whose "
                          "planner.cluster names them)")
    else:
        gpus, group_size = args.gpus, args.group_size or 8
        label = f"{args.planner or 'static'}/{args.policy or 'cmlfq'}"
    try:
        if design is None:
            model, gpu = load_model(args.model), load_gpu(args.cluster)
        prompts = args.prompts or max(8, gpus)
        if design is not None:  # spare batches replace rejected groups (the same trace for every design)
            trace = sim_design.design_trace(args.trace, args.steps, prompts, group_size, args.seed, args.drift,
                                             args.max_units)
        else:
            trace = sim_run.build_trace(args.trace, args.steps, prompts, group_size, args.seed, args.drift,
                                        args.max_units)
        print(f"trace {trace.source}: {args.steps} steps x {trace.batch} trajectories; mean tokens step 0 "
              f"{trace.mean_tokens(0):,.0f}, last step {trace.mean_tokens(args.steps - 1):,.0f}")
        checkpoint = _sim_checkpoint(args)
        every = max(1, args.steps // 10)
        report = lambda r: print(f"  step {r.step:4d}  t={r.time_s:9,.0f}s  step {r.interval_s:6.1f}s  "  # noqa: E731
                                 f"rollout {r.rollout_s:6.1f}s  train {r.train_s:6.1f}s") if r.step % every == 0 else None
        note = lambda line: print(line, flush=True)  # noqa: E731 - the first plan's choice, as it goes
        with checkpoint.stop_on_signals() if checkpoint is not None else contextlib.nullcontext():
            if design is not None:
                print(design.describe())
                played = sim_design.simulate_design(design, trace, args.steps, progress=report, checkpoint=checkpoint,
                                                    notes=note)
                result, extra = played.result, played.lines()
            else:
                replan = ReplanSettings(sim_workers=args.sim_workers if args.sim_workers is not None else 1)
                result, extra = sim_run.simulate(model, gpu, gpus, trace, args.planner or "static",
                                                 args.policy or "cmlfq",
                                                 SimConfig(staleness=1 if args.staleness is None else args.staleness,
                                                           max_workers=args.max_workers),
                                                 replan, progress=report, group_size=group_size,
                                                 checkpoint=checkpoint, notes=note), []
    except Stopped as stopped:  # SIGTERM/SIGINT with --checkpoint: saved, not lost
        print(f"libra sim: {stopped}", file=sys.stderr)
        return EXIT_STOPPED
    except InvalidArgument as error:
        raise ConfigError(str(error)) from None
    print("\n".join(sim_run.summary(result, decisions=args.decisions) + extra))
    if args.json:
        about = ({"config": args.config, "run": design.name, "planner": design.planner, "policy": design.sim.policy,
                  "ceiling_trajectories_per_s": played.ceiling.trajectories_per_s if played.ceiling else None,
                  "rejected": played.usage.rejected}
                 if design is not None else {"planner": args.planner or "static", "policy": args.policy or "cmlfq"})
        sim_run.write_json(args.json, sim_run.to_json(result, {**about, "gpus": gpus, "trace": trace.source}))
    if args.plot:
        sim_run.plot({label: result}, args.plot, f"{model.name}, {gpus} x {gpu.name}, {trace.source}")
    if checkpoint is not None:  # the run is done and written: nothing left to go on from
        checkpoint.path.unlink(missing_ok=True)
    return 0


EXIT_STOPPED = 75  # EX_TEMPFAIL: `libra sim --checkpoint` stopped by a signal after saving; run it again to go on
SIM_INPUTS = ("config", "set", "cluster", "model", "gpus", "steps", "trace", "policy", "planner", "prompts",
              "group_size", "seed", "drift", "staleness", "max_units", "max_workers")  # what a run's result depends on


def _sim_checkpoint(args: argparse.Namespace):
    """`libra sim --checkpoint FILE`: the run's inputs as its key (a config's file by its content too, so
    a checkpoint saved before the config was edited is refused instead of going on as if it were this
    run's); None without the flag."""
    import hashlib
    import json

    from libra.services.planner.sim.checkpoint import Checkpoint

    if not args.checkpoint:
        return None
    if not 0 <= args.checkpoint_every_s <= 86_400:
        raise ConfigError(f"--checkpoint-every-s must be 0..86400 seconds, got {args.checkpoint_every_s}")
    inputs = {name: getattr(args, name, None) for name in SIM_INPUTS}
    for name in ("config", "cluster", "model", "trace"):
        path = inputs[name]
        if path and pathlib.Path(path).is_file():
            inputs[f"{name}_sha256"] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16]
    key = json.dumps(inputs, sort_keys=True, default=str)
    checkpoint = Checkpoint(pathlib.Path(args.checkpoint), key=key, every_s=args.checkpoint_every_s)
    if checkpoint.path.exists():
        print(f"going on from the checkpoint {checkpoint.path}")
    return checkpoint
