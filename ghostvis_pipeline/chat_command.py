"""`ghostvis chat`: talk to any stage with a chat model (sft, dpo, rl) in the terminal, by default the
lineage's newest one; stdin may be piped (one reply per line on stdout). A reply ends at the end-of-turn
token, or any other special token (end of text, the next turn's marker), and no special token is printed."""

from __future__ import annotations

import sys

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan import selected
from ghostvis_core.plan.stages import chat_stage_names
from ghostvis_pipeline.subcommand import subcommand


def cmd_chat(args) -> int:
    """Talk to a chat stage's checkpoint: the chat template, KV-cached sampling, stop at the turn's end."""
    import torch

    from ghostvis_core.data.chat import render_prompt
    from ghostvis_core.run.trained_model import load_stage

    home = Home.from_env()
    ts = load_stage(home, args.stage or newest_chat_stage(home), args.run)
    tok, interactive = ts.tok, sys.stdin.isatty()
    turn_ends = special_ids(tok)
    gen = torch.Generator().manual_seed(args.seed)
    messages: list[dict] = []
    # which model answers: on stdout for a person, on stderr when piped (stdout holds only the replies)
    print(f"{ts.stage} ({ts.run_key}); empty line or Ctrl-D to quit", file=sys.stdout if interactive else sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or (interactive and not line.strip()):
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        with torch.no_grad():
            out = ts.model.generate(
                render_prompt(tok, messages)[-ts.config.model.max_seq_len + args.max_tokens :],
                args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                stop_tokens=turn_ends,
                generator=gen,
                vocab=tok.vocab_size,
            )
        reply = reply_text(tok, out)
        messages.append({"role": "assistant", "content": reply})
        # piped: one line per reply, so a script can pair prompts and answers
        print(f"assistant> {reply}" if interactive else " ".join(reply.splitlines()), flush=True)


def special_ids(tok) -> tuple[int, ...]:
    """Every special token's id: where a reply ends. A reply is content only, so <|eot|> (end of turn), an
    end of text (<|bos|>, <|endoftext|>) or a role marker starting the next turn each close it."""
    return tuple(sorted(tok.enc.encode_single_token(t) for t in tok.enc.special_tokens_set))


def reply_text(tok, out: list[int]) -> str:
    """The reply's text: the generated ids before the first special token (which is never printed)."""
    ends = set(special_ids(tok))
    cut = next((i for i, t in enumerate(out) if t in ends), len(out))
    return tok.decode(out[:cut])


def newest_chat_stage(home: Home) -> str:
    """The lineage's last stage with a chat model (Lineage.chat_stages) that has a completed run: rl, else dpo,
    else sft."""
    from ghostvis_core.runs.lookup import newest_completed_run

    chain = selected.lineage()
    chat = chain.chat_stages()
    for name in reversed(chat):
        if newest_completed_run(home.store, name):
            return name
    raise GhostvisError(
        f"no chat stage of the lineage {chain.name} ({', '.join(chat) or 'none'}) has a completed run; "
        f"materialize one (ghostvis train {chat[0] if chat else 'sft'}) or pass --stage"
    )


def add_parser(sub) -> None:
    c = subcommand(sub, "chat", help="chat with a trained stage in the terminal (stdin may be piped)", fn=cmd_chat)
    c.add_argument(
        "--stage",
        choices=chat_stage_names(),
        help="the stage whose model to open (default: the lineage's newest chat stage with a completed run)",
    )
    c.add_argument("--run", help="run key (default: the stage's newest completed run)")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    c.add_argument("--top-k", type=int, default=50)
    c.add_argument("--seed", type=int, default=0)
