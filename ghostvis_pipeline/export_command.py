"""`ghostvis export --stage sft --to DIR`: a trained stage as a Hugging Face checkpoint (transformers,
vLLM, lm-eval), with its tokenizer, chat template, for a vision stage vision/ beside it, its training
manifest and its model card (licence fields from $GHOSTVIS_HOME/summary.yaml when there is one)."""

from __future__ import annotations

from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_pipeline.subcommand import subcommand


def cmd_export(args) -> int:
    from ghostvis_core.run.hf.export import export_run
    from ghostvis_core.run.hf.summary_input import SUMMARY_FILE, read_declared

    home = Home.from_env()
    out = export_run(home.store, args.stage, args.run_key, args.to, read_declared(home.root / SUMMARY_FILE))
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
