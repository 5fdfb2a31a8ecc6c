"""The ``hfcpu`` server's batch: sequences decoded together over one key/value cache (decode thread only).

A sequence joins after its prefill (its own cache, batch of one) and leaves when it finishes; every decode step is
one forward pass over the last token of every sequence in the batch. The cache is left-padded to the longest
sequence and grows in place (:class:`_GrowingLayer`); the model's attention is torch's sdpa given grouped key/value
heads as they are (:data:`ATTENTION`, registered with transformers on import).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

__all__ = ["ATTENTION", "BatchRow", "DecodeBatch"]

# The model's attention: sdpa with grouped key/value heads left grouped (see _grouped_sdpa).
ATTENTION = "hfcpu_sdpa"
# Positions a batch's cache is allocated beyond its longest sequence (it grows by a quarter when they are used).
_MIN_CACHE_ROOM = 64


@dataclasses.dataclass(eq=False)
class BatchRow:
    """A request being decoded (decode thread only)."""

    request: Any  # the server's request: what the sequence answers when it leaves
    length: int  # tokens in its key/value cache: the prompt and every sampled token but the last
    logits: torch.Tensor  # the distribution of its next token
    seen: torch.Tensor | None  # prompt and output tokens, for the repetition penalty
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    left: bool = False


def _grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, but grouped key/value heads go to torch as they are (``enable_gqa``):
    transformers repeats them whenever there is a mask, a copy of the batch's whole cache per layer and step (about
    7x the attention's own time for 64 sequences of 1500 positions)."""
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None else True)
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _grouped_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class _GrowingLayer(DynamicLayer):
    """A cache layer whose keys and values live in buffers with room to grow: a decode step writes one position
    instead of copying the whole cache (``DynamicLayer`` concatenates)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._buffers = (keys, values)
        self._length = length
        self._expose()

    def _expose(self) -> None:
        self.keys = self._buffers[0][:, :, : self._length]
        self.values = self._buffers[1][:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        end = self._length + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:
            self._buffers = tuple(_with_room(buffer, self._length, end) for buffer in self._buffers)
        self._buffers[0][:, :, self._length : end] = key_states
        self._buffers[1][:, :, self._length : end] = value_states
        self._length = end
        self._expose()
        return self.keys, self.values


def _with_room(buffer: torch.Tensor, used: int, needed: int) -> torch.Tensor:
    """A zeroed ``[batch, heads, positions, dim]`` buffer for ``needed`` positions and room for more, holding the
    first ``used`` positions of ``buffer``."""
    batch, heads, _, dim = buffer.shape
    grown = buffer.new_zeros(batch, heads, needed + max(_MIN_CACHE_ROOM, needed // 4), dim)
    grown[:, :, :used] = buffer[:, :, :used]
    return grown


class DecodeBatch:
    """The sequences decoded together: one key/value cache left-padded to the longest sequence, one row each.

    Sequences join after their prefill and leave when they finish; the cache is rebuilt (rows dropped and added,
    padding trimmed) only before a decode step that follows such a change. Padding holds zeros (a masked position
    must stay finite: its attention weight is 0, and 0 * inf is not).
    """

    def __init__(self) -> None:
        self._rows: list[BatchRow] = []  # aligned with the cache's batch dimension
        self._joining: list[tuple[BatchRow, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._cache: Cache | None = None
        self._width = 0

    def sequences(self) -> list[BatchRow]:
        return [row for row in self._rows if not row.left] + [row for row, _ in self._joining if not row.left]

    def __len__(self) -> int:
        return len(self.sequences())

    def join(self, row: BatchRow, cache: Cache) -> None:
        self._joining.append((row, [(layer.keys, layer.values) for layer in cache.layers]))

    def step(self, model: torch.nn.Module) -> None:
        """One forward pass over every sequence's last token; each sequence's ``logits`` become its next ones."""
        if self._joining or any(row.left for row in self._rows):
            self._rebuild()
        if not self._rows:
            return
        lengths = torch.tensor([row.length for row in self._rows])
        padding = (self._width - lengths).unsqueeze(1)
        output = model(
            input_ids=torch.tensor([[row.tokens[-1]] for row in self._rows]),
            attention_mask=(torch.arange(self._width + 1).unsqueeze(0) >= padding).long(),
            position_ids=lengths.unsqueeze(1),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._width += 1
        for row, logits in zip(self._rows, output.logits[:, -1], strict=True):
            row.logits = logits
            row.length += 1

    def clear(self) -> list[BatchRow]:
        """Drop every sequence (after a failed step); returns those that had not left."""
        remaining = self.sequences()
        self._rows, self._joining, self._cache, self._width = [], [], None, 0
        return remaining

    def _rebuild(self) -> None:
        kept = [index for index, row in enumerate(self._rows) if not row.left]
        joining = [(row, states) for row, states in self._joining if not row.left]
        rows = [self._rows[index] for index in kept] + [row for row, _ in joining]
        self._joining = []
        if not rows:
            self.clear()
            return
        width = max(row.length for row in rows)
        index = torch.tensor(kept, dtype=torch.long)
        layers = []
        for layer in range(len(self._cache.layers) if self._cache is not None else len(joining[0][1])):
            pair = []
            for part in (0, 1):  # keys, values
                old = self._cache.layers[layer] if kept else None
                sample = joining[0][1][layer][part] if joining else (old.keys, old.values)[part]
                _, heads, _, dim = sample.shape
                buffer = sample.new_zeros(len(rows), heads, width + _MIN_CACHE_ROOM, dim)
                if old is not None:
                    old_states = (old.keys, old.values)[part].index_select(0, index)
                    # Every kept row is right-aligned at the old width; the leading columns cut are padding.
                    shared = min(width, self._width)
                    buffer[: len(kept), :, width - shared : width] = old_states[:, :, self._width - shared :]
                for offset, (row, states) in enumerate(joining, start=len(kept)):
                    buffer[offset, :, width - row.length : width] = states[layer][part][0]
                pair.append(buffer)
            layers.append(_GrowingLayer(pair[0], pair[1], width))
        self._rows, self._width = rows, width
        self._cache = Cache(layers=layers)
