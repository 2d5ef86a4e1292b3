"""How one token's MLA latent row is stored in the paged KV cache (``kv_cache_dtype``, vLLM's names).

A row is ``[kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``; per format the cache tensor of a layer
is ``[num_blocks, block_size, row_width]`` of ``storage_dtype``:

- ``auto``: the row in the model's compute dtype (576 values for DeepSeek's shape).
- ``fp8``: the whole row in e4m3 with one per-tensor scale (vLLM's flat layout): stored
  ``x / scale``, read ``q · scale``. The scale is 1.0 (vLLM's default when no ``k_scale`` is
  calibrated; our checkpoints carry none): RMS-normalised latents and rope keys sit far inside
  e4m3's ±448, and values beyond it saturate rather than overflow.
- ``fp8_ds_mla``: DeepSeek's / FlashMLA's row of bytes: ``kv_c`` in e4m3 quantised per group of
  128 values (its scale ``amax / 448``), those scales as float32, then ``k_pe`` unquantised in
  bf16 — 512 + 16 + 128 = 656 bytes for DeepSeek's shape.

Every write of latents goes through ``store`` and every read through ``load``, so the attention
paths see the compute dtype whatever the cache holds; the bytes a request moves between nodes are
the stored ones (``row_bytes`` each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.fp8 import FP8_DTYPE, FP8_MAX

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")
DS_MLA_GROUP = 128  # kv_c values per float32 scale in fp8_ds_mla
KERNEL_CODE = {"auto": 0, "fp8": 1, "fp8_ds_mla": 2}  # the Triton kernels' FMT of each format


@dataclass(frozen=True)
class KVFormat:
    """One cache format for a model of ``lora`` latent and ``rope`` rope dims computing in ``dtype``."""

    name: str  # one of KV_CACHE_DTYPES
    lora: int
    rope: int
    dtype: torch.dtype  # the compute dtype rows are stored from and loaded into
    scale: float = 1.0  # fp8: the per-tensor scale

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.name!r}")
        if self.name == "fp8_ds_mla" and self.lora % DS_MLA_GROUP:
            raise ValueError(f"kv_cache_dtype fp8_ds_mla needs kv_lora_rank divisible by {DS_MLA_GROUP}, "
                             f"got {self.lora}")
        if not self.scale > 0:
            raise ValueError(f"the fp8 KV scale must be > 0, got {self.scale}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"auto": self.dtype, "fp8": FP8_DTYPE, "fp8_ds_mla": torch.uint8}[self.name]

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per token (the cache tensor's last dim)."""
        if self.name == "fp8_ds_mla":
            return self.lora + 4 * (self.lora // DS_MLA_GROUP) + 2 * self.rope
        return self.lora + self.rope

    @property
    def row_bytes(self) -> int:
        return self.row_width * torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """Rows ``[T, lora + rope]`` (any float dtype) -> their stored form ``[T, row_width]``."""
        if self.name == "auto":
            return latent.to(self.dtype)
        if self.name == "fp8":
            return (latent.float() / self.scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        kv_c, k_pe = latent.float().split([self.lora, self.rope], dim=-1)
        groups = kv_c.reshape(-1, self.lora // DS_MLA_GROUP, DS_MLA_GROUP)
        scales = groups.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # [T, G]
        q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return torch.cat((q.view(torch.uint8).flatten(1), scales.view(torch.uint8),
                          k_pe.to(torch.bfloat16).view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., row_width]`` -> latents ``[..., lora + rope]`` in the compute dtype."""
        if self.name == "auto":
            return rows.to(self.dtype)
        if self.name == "fp8":
            return (rows.float() * self.scale).to(self.dtype)
        lead = rows.shape[:-1]
        g = self.lora // DS_MLA_GROUP
        q = rows[..., : self.lora].contiguous().view(FP8_DTYPE).float().reshape(*lead, g, DS_MLA_GROUP)
        scales = rows[..., self.lora : self.lora + 4 * g].contiguous().view(torch.float32)
        k_pe = rows[..., self.lora + 4 * g :].contiguous().view(torch.bfloat16)
        kv_c = (q * scales.unsqueeze(-1)).reshape(*lead, self.lora)
        return torch.cat((kv_c, k_pe.float()), dim=-1).to(self.dtype)

    def store(self, flat_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Write rows ``latent`` [T, lora + rope] at cache ``slots`` [T] of ``flat_cache`` [S, row_width]."""
        flat_cache[slots] = self.encode(latent)

    def load(self, flat_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The latents at ``slots`` (any shape) -> [*slots.shape, lora + rope] in the compute dtype."""
        return self.decode(flat_cache[slots])

    @property
    def wire_name(self) -> str:
        """The format as nodes publish it and KV handles carry it: ``auto`` resolved to its dtype (two
        nodes of ``auto`` in different dtypes hold different rows)."""
        return self.name if self.quantized else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"{self.name} ({self.row_bytes} B per token and layer)"

    def check_cache(self, cache: torch.Tensor, who: str) -> None:
        """ValueError, naming ``who``, unless ``cache`` [..., row width] holds this format's rows."""
        if cache.dtype != self.storage_dtype or cache.shape[-1] != self.row_width:
            raise ValueError(f"{who}: a cache of {cache.dtype} rows of {cache.shape[-1]} is not {self.describe()}")

    def check_device(self, device: torch.device, capability: tuple[int, int] | None = None) -> None:
        """Refuse, naming the GPU, a quantized format on a GPU without e4m3 (before compute capability 8.9:
        Ada, Hopper); ``capability``: the device's, asked of CUDA when None. CPUs emulate e4m3."""
        if not self.quantized or device.type != "cuda":
            return
        cap = capability or torch.cuda.get_device_capability(device)
        if tuple(cap) < (8, 9):
            name = torch.cuda.get_device_name(device) if capability is None else f"compute capability {cap}"
            raise ValueError(f"kv_cache_dtype {self.name} needs a GPU with FP8 (compute capability 8.9+: Ada, "
                             f"Hopper or later); {name} has {cap[0]}.{cap[1]}: use kv_cache_dtype auto")

