"""`ghostvis export --stage sft --to DIR`: a trained stage as a Hugging Face checkpoint (transformers,
vLLM, lm-eval), with its tokenizer, chat template and, for a vision stage, vision/ beside it."""

from __future__ import annotations

from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def cmd_export(args) -> int:
    from ghostvis_core.run.hf.export import export_run

    out = export_run(Home.from_env().store, args.stage, args.run_key, args.to)
    print(f"{args.stage}: exported to {out} (load with transformers.AutoModelForCausalLM.from_pretrained('{out}'))")
    return 0


def add_parser(sub) -> None:
    e = subcommand(
        sub,
        "export",
        help="write a trained stage as a Hugging Face checkpoint (LlamaForCausalLM + tokenizer)",
        fn=cmd_export,
    )
    e.add_argument("--stage", required=True, choices=stage_names())
    e.add_argument("--run-key", help="the run to export (default: the stage's newest completed run)")
    e.add_argument("--to", required=True, help="the output folder")
