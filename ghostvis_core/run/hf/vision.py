"""The vision stack (encoder, resampler, projector) beside an exported LM, in `vision/`: its own
config.json and model.safetensors, loaded back with `load_vision` (no transformers class exists for it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import VisionConfig
from ghostvis_core.run.model.vision import VisionStack

VISION_DIR = "vision"


def save_vision(stack: VisionStack, d_model: int, image_token_id: int, out_dir: Path) -> Path:
    """vision/config.json (VisionConfig, the LM width it projects to, the <|image|> id) + model.safetensors."""
    target = out_dir / VISION_DIR
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "vision": dataclasses.asdict(stack.cfg),
        "d_model": d_model,
        "image_token": "<|image|>",
        "image_token_id": image_token_id,
        "n_image_tokens": stack.cfg.n_latents,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in stack.state_dict().items()},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return target


def load_vision(folder: str | Path) -> VisionStack:
    """The exported vision stack, in eval mode: images (N, 3, H, W) in [0, 1] -> (N, n_latents, d_model)
    embeddings that replace the n_latents <|image|> positions of the prompt in the LM's input embeddings.
    `folder` is the export folder or its vision/ subfolder."""
    folder = Path(folder)
    folder = folder / VISION_DIR if (folder / VISION_DIR).is_dir() else folder
    try:
        config = json.loads((folder / "config.json").read_text())
        state = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise GhostvisError(
            f"vision stack {folder}: cannot read config.json / model.safetensors ({exc}); "
            "re-run `ghostvis export` for a vision stage"
        ) from None
    stack = VisionStack(VisionConfig(**config["vision"]), config["d_model"])
    stack.load_state_dict(state, strict=True)
    return stack.eval().to(torch.float32)


def image_embeds(
    lm, vision: VisionStack, input_ids: torch.Tensor, images: torch.Tensor, image_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, inputs_embeds) for a transformers LM with images: each <|image|> of the (1, T) prompt
    (as apply_chat_template renders it) expanded to n_latents positions, which take the image's
    embeddings, in order, as GhostVis's model does; pass both to lm(...) or lm.generate(...)."""
    ids = input_ids[0]
    keep = torch.where(ids == image_token_id, vision.cfg.n_latents, 1)
    expanded = ids.repeat_interleave(keep)[None]
    embeds = lm.get_input_embeddings()(expanded)
    mask = (expanded == image_token_id)[..., None]
    return expanded, embeds.masked_scatter(mask, vision(images).to(embeds.dtype))
