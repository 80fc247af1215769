"""Vision side of the VLM: a frozen image encoder, a perceiver resampler and an MLP projector.

The encoder is a small ViT for the tiny preset, or a local SigLIP checkpoint (through
`transformers`, when installed). The resampler turns the encoder's patch features into
`n_latents` vectors with learned latent queries and cross-attention; the projector maps them into
the LM's embedding space, where they replace the expanded <|image|> positions of a sequence.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import torch
import torch.nn as nn

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import VisionConfig


class ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch embedding + position embedding + pre-norm transformer blocks."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise GhostvisError(
                f"vision.image_size={cfg.image_size} must be a multiple of vision.patch_size={cfg.patch_size}"
            )
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch = nn.Conv2d(3, cfg.d_vision, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos = nn.Parameter(torch.randn(1, n_patches, cfg.d_vision) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(cfg.d_vision, cfg.n_heads) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_vision)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class SiglipEncoder(nn.Module):
    """A local SigLIP vision tower (never downloaded): `vision.encoder_path` names its folder."""

    def __init__(self, path: str):
        super().__init__()
        try:
            from transformers import SiglipVisionModel  # type: ignore
        except ImportError:
            raise GhostvisError(
                f"vision.encoder_path={path} needs the `transformers` package; pip install transformers, "
                "or unset vision.encoder_path to use the tiny ViT"
            ) from None
        self.model = SiglipVisionModel.from_pretrained(path, local_files_only=True)

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images * 2 - 1).last_hidden_state  # SigLIP expects [-1, 1]


class CrossAttentionLayer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm_q = nn.LayerNorm(d)
        self.norm_kv = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm_ff = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, latents, feats):
        q = self.norm_q(latents)
        kv = torch.cat([self.norm_kv(feats), q], dim=1)  # latents also attend to themselves (Flamingo)
        latents = latents + self.attn(q, kv, kv, need_weights=False)[0]
        return latents + self.ff(self.norm_ff(latents))


class PerceiverResampler(nn.Module):
    def __init__(self, d: int, n_latents: int, n_layers: int, heads: int):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n_latents, d) * 0.02)
        self.layers = nn.ModuleList(CrossAttentionLayer(d, heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = self.latents.expand(feats.shape[0], -1, -1)
        for layer in self.layers:
            x = layer(x, feats)
        return self.norm(x)


class Projector(nn.Module):
    """Two-layer MLP from the vision width to the LM's d_model."""

    def __init__(self, d_vision: int, d_model: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_vision, d_model), nn.GELU(), nn.Linear(d_model, d_model))

    def forward(self, x):
        return self.net(x)


class VisionStack(nn.Module):
    """images (N, 3, H, W) in [0, 1] -> (N, n_latents, d_model) embeddings for the LM."""

    def __init__(self, cfg: VisionConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = SiglipEncoder(cfg.encoder_path) if cfg.encoder_path else TinyViT(cfg)
        width = self.encoder.width if cfg.encoder_path else cfg.d_vision
        self.resampler = PerceiverResampler(width, cfg.n_latents, cfg.resampler_layers, cfg.n_heads)
        self.projector = Projector(width, d_model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.resampler(self.encoder(images)))

    def trainable_for_alignment(self) -> list[nn.Parameter]:
        return [*self.resampler.parameters(), *self.projector.parameters()]


def decode_images(blobs: list[bytes], size: int) -> torch.Tensor:
    """Encoded images (PNG/JPEG bytes) -> float tensor (N, 3, size, size) in [0, 1]."""
    from PIL import Image

    out = []
    for blob in blobs:
        img = Image.open(io.BytesIO(blob)).convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BICUBIC)
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(out) if out else torch.zeros(0, 3, size, size)


def splice_images(x: torch.Tensor, image_mask: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
    """Write image embeddings, in order, into the positions marked by image_mask (B, T)."""
    n = int(image_mask.sum())
    if n != image_embeds.shape[0] * image_embeds.shape[1]:
        raise ValueError(f"{n} image positions for {image_embeds.shape[0]} images x {image_embeds.shape[1]} latents")
    return x.masked_scatter(image_mask[..., None], image_embeds.to(x.dtype))


def frozen_fingerprint(module: nn.Module) -> str:
    """sha256 over the frozen parameters' bytes: equal before and after training means untouched."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if not p.requires_grad:
            h.update(name.encode())
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a sharded (FSDP) parameter: all ranks call
            h.update(full.detach().to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()
