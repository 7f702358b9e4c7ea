"""The `libra` command.

    libra up --config configs/quickstart.yaml [--fresh | --resume]   # the whole job on one machine
    libra serve SERVICE --config FILE [--port P]   # one service (what compose and Slurm run)
    libra status --config FILE [--watch [SECONDS]] # health, plan, pool, workers, buckets, trainer (live)
    libra report RUN_DIR [--out FILE]              # one self-contained HTML page about a run
    libra check-config --config FILE               # validate a config (model, data, ports too), print it
    libra plan --cluster HW.yaml --model M.yaml --trace T --gpus N   # preflight allocation
    libra plan explain --config FILE               # the planner's decisions and calibration
    libra data prepare WORKLOAD --source RAW [--out FILE]   # a dataset -> Libra's prompt JSONL
    libra sim --cluster HW.yaml --model M.yaml --gpus N --steps S --trace synthetic|r2e|FILE   # cluster simulator
    libra sim --config FILE [--set KEY=VALUE] --steps S --trace ...   # the design a run config describes

Every command that reads a run config takes it as `--config FILE` (check-config also as a plain
FILE argument), with `--set KEY=VALUE` overrides.

Exit codes: 0 success, 1 a failure while running, 2 an invalid config or command line (or, for
`libra up`, ports in use or a finished run), 128 + N stopped by signal N (130 Ctrl-C, 143
SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from libra.cli_config import client, load
from libra.cli_planning import cmd_plan, cmd_plan_explain, cmd_sim, degrees
from libra.errors import ConfigError, FailedPrecondition
from libra.routing.names import POLICY_NAMES

SERVICES = ("planner", "scheduler", "trainer", "rollout", "elastic")
POLICY_CHOICES = POLICY_NAMES  # the routing policies (libra.routing; no pydantic at start-up)


def cmd_serve(args: argparse.Namespace) -> int:
    config = load(args)
    if not config.redis.url:
        raise ConfigError("redis.url: `libra serve` needs a Redis URL; pass --redis-url or set LIBRA_REDIS_URL")
    from libra import log

    log.configure(args.service, config.run_id)
    module = __import__(f"libra.services.{args.service}.server", fromlist=["serve"])
    return module.serve(config, args.port)


def cmd_up(args: argparse.Namespace) -> int:
    from libra.up import up

    return up(load(args), fresh=args.fresh, resume=args.resume)


def cmd_status(args: argparse.Namespace) -> int:
    from libra.status import print_status, watch_status

    if args.watch is not None:
        if args.watch <= 0:
            raise ConfigError(f"--watch takes the seconds between refreshes, a number above 0; got {args.watch}")
        return watch_status(client(args), args.watch)
    return print_status(client(args))


def cmd_report(args: argparse.Namespace) -> int:
    from libra.telemetry.report import write_report

    try:
        print(f"report: {write_report(args.run_dir, args.out)}")
    except ImportError as error:  # the control plane alone: no matplotlib
        raise FailedPrecondition(f"libra report draws its charts with matplotlib, which is not installed "
                                 f"({error}); pip install matplotlib") from None
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from libra.workloads.data_prepare import prepare

    summary = prepare(args.workload, args.source, args.out or f"data/{args.workload}.jsonl", args.limit)
    print("\n".join(summary.lines()))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import yaml

    if args.config_path and args.config and args.config_path != args.config:
        raise ConfigError(f"check-config was given two configs, {args.config_path} and --config {args.config}; "
                          "pass one")
    args.config = args.config or args.config_path
    if not args.config:
        raise ConfigError("check-config needs a config: libra check-config --config FILE")
    config = load(args)
    if not args.offline:
        from libra.checks import check_model, check_ports, check_workload

        check_model(config)  # each raises ConfigError naming the field: exit 2
        check_workload(config)
        if not args.no_ports:
            check_ports(config)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _common(parser: argparse.ArgumentParser, config_required: bool) -> None:
    parser.add_argument("--config", required=config_required, help="run config (YAML)")
    parser.add_argument("--redis-url", help="Redis URL (overrides redis.url and LIBRA_REDIS_URL)")
    parser.add_argument("--run-id", help="override run_id")
    parser.add_argument("--run-dir", help="override run_dir")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override any config field, e.g. --set trainer.steps=5 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="libra", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--port", type=int, help="listen port (default: the config's address)")
    _common(serve, config_required=False)
    serve.set_defaults(func=cmd_serve)
    up = sub.add_parser("up", help="run the whole job on this machine",
                        description="Run the whole job on this machine. Over an existing run directory it "
                                    "resumes from the trainer's last checkpoint; a finished run is refused "
                                    "(exit 2) until --fresh or a larger trainer.steps.")
    _common(up, config_required=True)
    start = up.add_mutually_exclusive_group()
    start.add_argument("--fresh", action="store_true",
                       help="start over: move an existing run directory aside to RUN_DIR.prev-<time> (and, on "
                            "a Redis given by redis.url or --redis-url, delete the run's keys there)")
    start.add_argument("--resume", action="store_true",
                       help="insist on resuming: fail (exit 2) if the run directory has nothing to resume")
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="show health, plan, pool, workers, buckets and trainer progress")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                        help="refresh in place every SECONDS (default 2) until the run is done or Ctrl-C; plain "
                             "text, one block per refresh, when the output is not a terminal")
    _common(status, config_required=False)
    status.set_defaults(func=cmd_status)
    report = sub.add_parser("report", help="write one self-contained HTML page about a run (RUN_DIR/report.html)",
                            description="Write one self-contained HTML page about a run from its run record "
                                        "(RUN_DIR/telemetry/): reward, step time, rollout, buckets and moves, the "
                                        "planner's decisions, staleness, worker lag. Works on a finished, stopped "
                                        "or running run.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (the config's run_dir)")
    report.add_argument("--out", help="where to write the page (default RUN_DIR/report.html)")
    report.set_defaults(func=cmd_report)
    plan = sub.add_parser("plan", help="preflight: choose an allocation for a cluster, model and trace")
    plan.add_argument("--cluster", help="hardware description, e.g. configs/hardware/h200-141g.yaml (required)")
    plan.add_argument("--model", help="model description, e.g. configs/models/qwen3-14b.yaml (required)")
    plan.add_argument("--trace", help="trace file in any format `libra sim` reads: CSV or JSON lines of "
                      "prompt_tokens,output_tokens, a trajectory JSONL (configs/traces/*.jsonl: its last step's "
                      "batch), or a run's RUN_DIR/trace.jsonl (required)")
    plan.add_argument("--gpus", type=int, help="GPU budget shared by training and rollout: any count >= 2, "
                      "one node, or nodes and a part of one (required)")
    plan.add_argument("--batch", type=int, default=0,
                      help="sequences per training step, drawn (seed 0) from the trace; default: the whole trace "
                      "is one step (a recorded run's trace.jsonl holds many steps: pass e.g. --batch 1024)")
    plan.add_argument("--group-size", type=int, default=8,
                      help="GRPO samples per prompt: each data-parallel replica trains whole groups (default 8)")
    plan.add_argument("--tp", dest="tp_choices", type=degrees, metavar="1,2,4,8",
                      help="tensor-parallel degrees to try on both sides (default 1,2,4,8)")
    plan.add_argument("--pp", dest="pp_choices", type=degrees, metavar="1,2,4,8",
                      help="training pipeline-parallel degrees to try (default 1,2,4,8)")
    plan.add_argument("--min-train-gpus", type=int, help="fewest GPUs for training (default 1)")
    plan.add_argument("--min-rollout-gpus", type=int, help="fewest GPUs for rollout (default 1)")
    plan.add_argument("--whole-nodes", choices=("auto", "on", "off"), default="auto",
                      help="on: each side gets whole nodes; off: the sides may share a node (TP groups never "
                           "straddle one); auto (default): on for clusters of two or more whole nodes unless "
                           "that costs over 5%% of the predicted step, and the output says which and why")
    plan.add_argument("--top-k", type=int, default=5, help="alternatives to show")
    plan.add_argument("--simulate", action="store_true",
                      help="rank the search's shortlist by playing the batch through the cluster simulator (the "
                           "asynchronous pipeline, the router; as a run's first plan is chosen) instead of by the "
                           "closed form's one synchronous step; seconds to a minute at thousands of GPUs")
    plan.add_argument("--staleness", type=int, default=1, help="with --simulate: the run's staleness bound")
    plan.add_argument("--sim-workers", type=int, default=0,
                      help="with --simulate: processes replaying the plans side by side (default 0: one per core, "
                           "at most 16; 1: one after the other); the ranking is the same either way")
    plan.add_argument("--policy", default="cmlfq", choices=POLICY_CHOICES,
                      help="with --simulate: the run's routing policy")
    plan.set_defaults(func=cmd_plan)
    plan_sub = plan.add_subparsers(dest="plan_command")
    explain = plan_sub.add_parser("explain", help="a running planner's recent decisions and calibration")
    explain.add_argument("--limit", type=int, default=10, help="decisions to show (latest)")
    explain.add_argument("--json", action="store_true", help="print the Explain reply as JSON")
    _common(explain, config_required=False)
    explain.set_defaults(func=cmd_plan_explain)
    check = sub.add_parser("check-config", help="validate a config and print it with defaults",
                           description="Validate a config and print it resolved. Also checks what can be checked "
                                       "before a start: model.path, the workload's data (readable, at least one "
                                       "valid row) and the ports the run listens on here. Exit 2 names the field.")
    check.add_argument("config_path", nargs="?", help=argparse.SUPPRESS)  # the older form: check-config FILE
    check.add_argument("--no-ports", action="store_true",
                       help="skip the port checks (checking a config while its run is up, or for another host)")
    check.add_argument("--offline", action="store_true",
                       help="only validate the config itself: no model, data or port checks")
    _common(check, config_required=False)
    check.set_defaults(func=cmd_check)
    sim = sub.add_parser("sim", help="simulate the whole loop at cluster scale (plans, routing, drift)")
    sim.add_argument("--config", help="a run config: simulate the design it describes at the scale of its "
                                      "planner.cluster (services/planner/sim/design.py); then --set overrides, "
                                      "and --cluster, --model, --gpus, --policy, --planner, --staleness, "
                                      "--group-size are the config's")
    sim.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="with --config: override a config field, e.g. --set planner.cluster.gpus=512")
    sim.add_argument("--cluster", help="hardware description, e.g. configs/hardware/h200-141g.yaml")
    sim.add_argument("--model", help="model description, e.g. configs/models/qwen2.5-7b.yaml")
    sim.add_argument("--gpus", type=int, help="GPU budget shared by training and rollout")
    sim.add_argument("--steps", type=int, default=100, help="training steps to simulate")
    sim.add_argument("--trace", default="synthetic",
                     help="'synthetic' (drifting long-tailed agentic), 'r2e' (R2E-Gym-like SWE agent: "
                          "libra/traces/r2e.py) or a trace file: trajectory JSONL, CSV "
                          "prompt_tokens,output_tokens, or a runtime-history export")
    sim.add_argument("--policy", choices=POLICY_CHOICES,
                     help="scheduler routing policy (default cmlfq)")
    sim.add_argument("--planner", choices=("static", "tp2", "online"),
                     help="static (default): best plan for step 0; tp2: homogeneous TP-2; online: the replanner")
    sim.add_argument("--prompts", type=int, default=0, help="prompts per step (default: max(8, gpus))")
    sim.add_argument("--group-size", type=int, help="GRPO samples per prompt (default 8)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    sim.add_argument("--drift", type=float, default=1.0, help="generated lengths grow by 1 + drift over the run")
    sim.add_argument("--staleness", type=int, help="batches rollout may run ahead of training (default 1)")
    sim.add_argument("--max-units", type=int, default=1024,
                     help="simulated trajectories per step; above it one stands for several identical ones")
    sim.add_argument("--max-workers", type=int, default=256, help="engines simulated one by one; above it pooled")
    sim.add_argument("--sim-workers", type=int,
                     help="processes replaying the planner's candidate plans side by side (0: one per core, at "
                          "most 16; default: the config's planner.replan.sim_workers, else 1); the same results")
    sim.add_argument("--checkpoint", metavar="FILE",
                     help="save the run's whole state here as it goes, and go on from this file if it exists "
                          "(a run of the same inputs: a long run stopped or killed loses at most "
                          "--checkpoint-every-s of work; SIGTERM or Ctrl-C saves at the step's end and exits "
                          "75); removed once the run is done")
    sim.add_argument("--checkpoint-every-s", type=float, default=300.0,
                     help="wall seconds between checkpoints, at a step's end (0: after every step)")
    sim.add_argument("--decisions", action="store_true",
                     help="print every decision the online replanner recorded (step, moved or kept, why); "
                          "--json always holds them")
    sim.add_argument("--json", help="write the result as JSON here")
    sim.add_argument("--plot", help="write throughput over steps as a PNG here")
    sim.set_defaults(func=cmd_sim)
    data = sub.add_parser("data", help="dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="convert a public dataset file into Libra's prompt JSONL")
    prepare.add_argument("workload", choices=("gsm8k", "dapo_math", "search_r1"), help="workload the data is for")
    prepare.add_argument("--source", required=True, help="the dataset file: .parquet or JSON lines")
    prepare.add_argument("--out", help="prompt file to write (default: data/WORKLOAD.jsonl)")
    prepare.add_argument("--limit", type=int, default=0, help="stop after this many valid rows (0: all)")
    prepare.set_defaults(func=cmd_data_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.func
    try:
        return handler(args)
    except ConfigError as error:
        print(f"libra: {error}", file=sys.stderr)
        return 2
    except FailedPrecondition as error:
        print(f"libra: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
