"""Trainer vs a bare PyTorch loop on the same model, batch shape, world size and precision.

- trainer: the real entry point, the line `ghostvis prepare pretrain --preset tiny --set budget.steps=N`
  prints (planned before the clock starts): `torchrun --standalone --nproc_per_node=2 -m ghostvis_core.run
  --spec URI` (eval and checkpoints only at the end), gloo,
  1 thread per rank; tokens/s is the trainer's own figure (RUN_COMPLETE.json `tokens_per_sec`:
  end of step 1 to end of step N, before the final eval/checkpoint).
- bare: benchmarks/_bare_loop.py under the same torchrun: GPT from the run's resolved config, DDP,
  AdamW (same hyperparameters), pre-generated random batches of the same shape, autocast, clipping;
  timed the same way.

Goals (best of --repeats runs each): trainer/bare tokens/s >= 0.95 (bf16, the default `auto` precision on this CPU);
first optimizer step <= 10 s from launching torchrun. Also reported: fp32 for both, bf16/fp32.

    .venv/bin/python benchmarks/trainer_throughput.py [--home PATH] [--steps 50] [--repeats 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

from ghostvis_core.home import Home  # noqa: E402

GOAL_RATIO = 0.95
GOAL_FIRST_STEP_S = 10.0


def trainer_run(home: Path, wd: Path, preset: str, steps: int, precision: str | None, tag: str) -> dict:
    sets = [f"budget.steps={steps}", "eval.every_steps=1000000", "checkpoint.every_steps=1000000"]
    if precision:
        sets.append(f"runtime.precision={precision}")
    run = C.run_stage(home, "pretrain", preset, sets, log=wd / f"trainer-{tag}.log", timeout=900)
    rc = run.run_complete
    if rc is None:
        raise C.BenchError(f"trainer run {tag}: no run record (RUN_COMPLETE.json) for run {run.run_key}; log {run.log}")
    tps_step = rc.batch.tokens_per_step
    half = C.nearest_logged(run.steps, steps // 2)
    started = run.first_line(lambda line: C.START_RE.match(line) is not None)
    step1 = run.first_line(lambda line: line.startswith("[pretrain] step 1/"))
    bf16 = "bf16=True" in (started[1] if started else "")
    return {
        "tag": tag,
        "run_key": run.run_key,
        "bf16": bf16,
        "tokens_per_sec": rc.tokens_per_sec,
        "mfu": rc.mfu,
        "flops_per_token": rc.flops_per_token,
        "peak_flops": rc.peak_flops,
        "peak_source": rc.peak_source,
        "tokens_per_sec_late": C.window_rate(run.steps, tps_step, half, steps) if half else None,
        "late_window": [half, steps],
        "tokens_per_step": tps_step,
        "first_step_s_wall": step1[0] if step1 else None,
        "start_line_s": started[0] if started else None,
        "first_step_s_inside": rc.first_step_s,
        "wall": run.wall,
        "other_cores": run.other_cores,
        "spec": str(Home(home).store.fetch("run_spec", "pretrain", run.run_key)),
        "shape": f"{rc.batch.micro_batch_size}x{rc.batch.seq_len}x{rc.batch.world_size}x{rc.batch.grad_accum_steps}",
    }


def best(runs: list[dict], key: str = "tokens_per_sec") -> dict:
    return max(runs, key=lambda r: r[key] or 0.0)


def main() -> int:
    ap = C.arguments(__doc__, C.TOKENIZED_HOME_HELP)
    ap.add_argument("--preset", default="tiny", help="preset of the pretrain run (default tiny)")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per bf16 run (default 50)")
    ap.add_argument("--fp32-steps", type=int, default=30, help="optimizer steps per fp32 run (default 30)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="bf16 trainer/bare pairs; the best of each counts (tokens/s: highest, first step: lowest)",
    )
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 runs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, homes)")
    args = ap.parse_args()

    print(C.load_snapshot("before trainer_throughput"), flush=True)
    with C.work_folder("trainer", keep=args.keep) as wd:
        src, how = C.home_arg_or_build(args.home, wd)
        home = C.scratch_home(src, wd / "train_home")
        print(f"data home: {how}; training runs in {home}", flush=True)

        trainers, bares = [], []
        for i in range(args.repeats):
            print(f"[{i + 1}/{args.repeats}] trainer bf16 (precision auto), {args.steps} steps ...", flush=True)
            trainers.append(trainer_run(home, wd, args.preset, args.steps, None, f"auto{i}"))
            precision = "bf16" if trainers[-1]["bf16"] else "fp32"  # what the trainer picked: like for like
            print(f"[{i + 1}/{args.repeats}] bare loop {precision}, {args.steps} steps ...", flush=True)
            bares.append(C.bare_run(trainers[0]["spec"], wd, args.steps, precision, f"{precision}-{i}"))
        t32 = b32 = None
        if not args.no_fp32:
            print(f"trainer fp32, {args.fp32_steps} steps ...", flush=True)
            t32 = trainer_run(home, wd, args.preset, args.fp32_steps, "fp32", "fp32")
            print(f"bare loop fp32, {args.fp32_steps} steps ...", flush=True)
            b32 = C.bare_run(trainers[0]["spec"], wd, args.fp32_steps, "fp32", "fp32")

        t, b = best(trainers), best(bares)
        if not t["bf16"]:
            print(
                "note: runtime.precision=auto did not pick bf16 on this machine (no AVX512-BF16/AMX); trainer "
                "and bare loop both ran fp32",
                flush=True,
            )
        rows = []
        for r in trainers + ([t32] if t32 else []):
            rows.append(
                [
                    f"trainer {r['tag']}",
                    r["shape"],
                    "bf16" if r["bf16"] else "fp32",
                    r["tokens_per_sec"],
                    r["tokens_per_sec_late"],
                    r["first_step_s_wall"],
                    r["wall"],
                    r["other_cores"],
                ]
            )
        for r in bares + ([b32] if b32 else []):
            rows.append(
                [
                    f"bare {r['tag']}",
                    r["shape"],
                    r["precision"],
                    r["tokens_per_sec"],
                    r["tokens_per_sec_late"],
                    r["first_step_s_wall"],
                    r["wall"],
                    r["other_cores"],
                ]
            )
        print()
        print(
            C.table(
                rows,
                [
                    "run",
                    "mbs x seq x world x accum",
                    "precision",
                    "tok/s (excl. step 1)",
                    "tok/s (2nd half)",
                    "launch->step 1 s",
                    "wall s",
                    "other cores",
                ],
            )
        )
        print()
        ratio = t["tokens_per_sec"] / b["tokens_per_sec"]
        ratio_late = (
            t["tokens_per_sec_late"] / b["tokens_per_sec_late"]
            if t["tokens_per_sec_late"] and b["tokens_per_sec_late"]
            else None
        )
        print(C.goal("trainer/bare tokens/s (bf16)", ratio, GOAL_RATIO))
        if ratio_late is not None:
            print(
                f"  (second half of the run only, steps {t['late_window'][0]}..{t['late_window'][1]}: {ratio_late:.3f})"
            )
        print(
            f"trainer MFU = {t['mfu']:.3f} (RUN_COMPLETE.json: {t['tokens_per_sec']:,.0f} tok/s x "
            f"{t['flops_per_token'] / 1e6:.2f} MFLOP/token / ({t['shape'].split('x')[2]} ranks x "
            f"{t['peak_flops'] / 1e9:.1f} GFLOP/s, {t['peak_source']}))"
        )
        first = min(trainers, key=lambda r: r["first_step_s_wall"] or float("inf"))
        print(
            C.goal(
                f"first optimizer step, launch -> '[pretrain] step 1/' line (best of {len(trainers)}: "
                + ", ".join(f"{r['first_step_s_wall']:.2f}" for r in trainers)
                + ")",
                first["first_step_s_wall"],
                GOAL_FIRST_STEP_S,
                higher_is_better=False,
                unit=" s",
            )
        )
        print(
            f"  launch -> run start line (imports, prepare_run, model, ranks up): {first['start_line_s']:.2f} s; "
            f"RUN_COMPLETE first_step_s (inside train(), incl. step-0 eval): {first['first_step_s_inside']:.2f} s"
        )
        results = {
            "trainer_tok_s": t["tokens_per_sec"],
            "bare_tok_s": b["tokens_per_sec"],
            "trainer_over_bare": ratio,
            "trainer_over_bare_late": ratio_late,
            "first_step_s": first["first_step_s_wall"],
            "first_step_s_inside": first["first_step_s_inside"],
            "trainer_mfu": t["mfu"],
        }
        if t32 and b32:
            r16_32 = t["tokens_per_sec"] / t32["tokens_per_sec"]
            print(
                f"bf16/fp32 trainer tokens/s = {r16_32:.3f} (info; auto picks "
                f"{'bf16' if t['bf16'] else 'fp32'}; -> {'goal met' if r16_32 >= 1.0 else 'goal missed'}: "
                f"auto must not be slower than fp32)"
            )
            print(
                f"  fp32: trainer/bare = {t32['tokens_per_sec'] / b32['tokens_per_sec']:.3f}; "
                f"bare bf16/fp32 = {b['tokens_per_sec'] / b32['tokens_per_sec']:.3f}"
            )
            results.update(
                trainer_fp32_tok_s=t32["tokens_per_sec"],
                bare_fp32_tok_s=b32["tokens_per_sec"],
                trainer_bf16_over_fp32=r16_32,
                trainer_over_bare_fp32=t32["tokens_per_sec"] / b32["tokens_per_sec"],
            )
        worst = max(r["other_cores"] for r in trainers + bares + [x for x in (t32, b32) if x])
        print(f"other load during the timed runs: up to {worst:.2f} cores ({C.noise_note(worst)})")
        results["max_other_cores"] = worst
        results["goal_ratio_met"] = int(ratio >= GOAL_RATIO)
        results["goal_first_step_met"] = int(
            first["first_step_s_wall"] is not None and first["first_step_s_wall"] <= GOAL_FIRST_STEP_S
        )
        print(C.kv_line(results))
        return 0


if __name__ == "__main__":
    C.main_wrapper(main)
