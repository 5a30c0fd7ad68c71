"""Prompt encoding for LTX-2: Gemma hidden states -> the video and audio text contexts.

Same computation as the official pipeline's prompt encoding (without prompt enhancement): Gemma 3
runs each prompt on its own (padded to the tokenizer's fixed length) and returns the hidden states
of all its layers; Gemma is then let go, and the checkpoint's embeddings processor (feature
extractor + video and audio connectors) turns each prompt's hidden states into the two contexts
the transformer cross-attends to. The two halves are separate functions so that the fleet can run
Gemma where it fits and the small processor anywhere.

ComfyUI's own LTX-2 text encoder hands a prompt over in another layout, one tensor with the video
and audio contexts concatenated on the last dim; for LTX-2.3 (and LTX-2.0 without the connectors in
the text encoder's file) it stops before the embeddings connectors and flags that
(``unprocessed_ltxav_embeds``), leaving them to the model. ``contexts_from_comfy`` turns either form
back into the two contexts, running the checkpoint's connectors where ComfyUI's model would.

It runs inside a rank on whatever models the loader hands it; it never talks to other ranks (the
fleet decides which rank encodes and broadcasts the result).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mgpu_backend.ltx.safetensors_header import read_header

GemmaOutput = tuple[tuple[torch.Tensor, ...], torch.Tensor]
"""One prompt through Gemma: (hidden states of the embeddings and every layer, attention mask)."""


@dataclass(frozen=True)
class TextContext:
    """What one prompt conditions the transformer with: ``[1, tokens, dim]`` per modality."""

    video_context: torch.Tensor
    audio_context: torch.Tensor


def encode_prompts(loader, prompts: list[str], gemma=None) -> list[TextContext]:
    """Encode every prompt; one ``TextContext`` per prompt, in order, on ``loader.device``.

    ``gemma`` is an already built Gemma (the fleet's cached one, perhaps with its layers over several
    GPUs); without it the loader builds one and lets it go before the embeddings processor is built."""
    if not prompts:
        raise ValueError("no prompts to encode; pass at least one (an empty string is a valid prompt)")
    gemma_outputs = gemma_hidden_states(loader, loader.gemma() if gemma is None else gemma, prompts)
    # Gemma is by far the largest text model: no frame holds it once its hidden states are taken, so
    # a Gemma built here is gone before the processor is built.
    return contexts_from_gemma(loader, gemma_outputs)


def gemma_hidden_states(loader, gemma, prompts: list[str]) -> list[GemmaOutput]:
    """The Gemma half of ``encode_prompts``: each prompt's hidden states and attention mask on ``loader.device``."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden_states, attention_mask = gemma.encode(prompt)
            # Sharded: each layer's output sits on that layer's GPU; the processor runs on the loader's device.
            outputs.append((tuple(state.to(loader.device) for state in hidden_states), attention_mask.to(loader.device)))
    return outputs


def contexts_from_gemma(loader, gemma_outputs: list[GemmaOutput]) -> list[TextContext]:
    """The embeddings-processor half of ``encode_prompts``."""
    with torch.inference_mode():
        processor = loader.embeddings_processor()
        contexts = []
        for hidden_states, attention_mask in gemma_outputs:
            processed = processor.process_hidden_states(hidden_states, attention_mask)
            contexts.append(TextContext(video_context=processed.video_encoding, audio_context=processed.audio_encoding))
    return contexts


COMFY_CONNECTOR_TOKENS = 1024
"""ComfyUI's connectors fill a prompt's tokens up to this length (or the next multiple of the register
count above a longer prompt) with the learnable registers, as Gemma's fixed padding does in ltx-core."""


def connector_widths(checkpoint_path: str) -> tuple[int, int]:
    """The widths of the video and audio text contexts of a checkpoint: its connectors' inner widths,
    read from the file's header (the connectors themselves need not be built to split a context)."""
    header = read_header(checkpoint_path, "checkpoint", "Choose the LTX-2 audio+video checkpoint.")
    widths = []
    for modality in ("video", "audio"):
        name = f"model.diffusion_model.{modality}_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight"
        if name not in header.tensors:
            raise ValueError(f"the checkpoint has no {modality} text connector ({name}): it is not an LTX-2 audio+video checkpoint")
        widths.append(header.tensors[name][1][0])
    return widths[0], widths[1]


def contexts_from_comfy(context: torch.Tensor, unprocessed: bool, input_name: str, widths: tuple[int, int], embeddings_processor) -> TextContext:
    """One prompt's contexts from ComfyUI's layout ``[1, tokens, video_width + audio_width]``
    (``widths``: ``connector_widths`` of the checkpoint).

    ``unprocessed`` (ComfyUI's ``unprocessed_ltxav_embeds``): ``context`` holds the text features before
    the embeddings connectors (LTX-2.0: one ``[1, tokens, width]`` feature both connectors read); they
    run here as ComfyUI's model runs them (``embeddings_processor()``: ltx-core's, built only then):
    the prompt's tokens first, the learnable registers after. Otherwise ``context`` is the
    connectors' output and is only split. A width that fits neither is another model's conditioning
    and is refused."""
    video_width, audio_width = widths
    if context.ndim != 3 or context.shape[0] != 1:
        raise ValueError(f"the {input_name} conditioning must be one prompt [1, tokens, width], got {tuple(context.shape)}")
    width = context.shape[-1]
    if width == video_width + audio_width:
        video, audio = context.split([video_width, audio_width], dim=-1)
    elif unprocessed and width == video_width == audio_width:
        video, audio = context, context
    else:
        raise ValueError(
            f"the {input_name} conditioning is {width} wide, but this checkpoint's text contexts are {video_width} (video) + "
            f"{audio_width} (audio) wide: it was encoded for another model; encode the prompt with MGPU Text Encode, or with "
            "CLIPTextEncode over LTXAVTextEncoderLoader given this checkpoint"
        )
    if not unprocessed:
        return TextContext(video_context=video.contiguous(), audio_context=audio.contiguous())
    return _connected(embeddings_processor(), video, audio)


COMFY_CONNECTOR_ROPE = {"positional_embedding_max_pos": [4096], "double_precision_rope": True}
"""The connectors' RoPE settings ComfyUI's model uses whatever the checkpoint's config says. ltx-core
reads them from the config: LTX-2.3's sets these very values; a config without them (the tiny
bundles') gets [1] and float32 frequencies in ltx-core, which ComfyUI's text features were not meant
for. Under these settings the connectors give ComfyUI's model's contexts to float32 rounding."""


@contextmanager
def comfy_connector_rope(processor) -> Iterator[None]:
    """The processor's connectors with ComfyUI's RoPE settings for the ``with`` block, then their own
    again (plain attributes read in ``forward``: nothing is copied or rebuilt)."""
    connectors = (processor.video_connector, processor.audio_connector)
    saved = [{name: getattr(connector, name) for name in COMFY_CONNECTOR_ROPE} for connector in connectors]
    try:
        for connector in connectors:
            for name, value in COMFY_CONNECTOR_ROPE.items():
                setattr(connector, name, value)
        yield
    finally:
        for connector, values in zip(connectors, saved, strict=True):
            for name, value in values.items():
                setattr(connector, name, value)


def _connected(processor, video_features: torch.Tensor, audio_features: torch.Tensor) -> TextContext:
    """The connectors over ComfyUI's unpadded text features as ComfyUI's model runs them: left-padded
    to ComfyUI's register fill length with a mask that hides the padding, which ltx-core's connectors
    replace by the same registers at the same positions as ComfyUI's; ComfyUI's RoPE settings."""
    # Imported here, not with the module: ltx-core's Gemma package pulls in transformers, whose import of
    # torch's DTensor package changes how a rank's gloo collective fails when a peer breaks the groups.
    from ltx_core.text_encoders.gemma.embeddings_processor import convert_to_additive_mask

    registers = processor.video_connector.num_learnable_registers
    assert registers == processor.audio_connector.num_learnable_registers, "the two connectors fill with different register counts"
    tokens = video_features.shape[1]
    length = math.ceil(max(COMFY_CONNECTOR_TOKENS, tokens) / registers) * registers if registers else tokens
    parameter = next(processor.parameters())
    mask = torch.cat([torch.zeros(1, length - tokens, dtype=torch.int64), torch.ones(1, tokens, dtype=torch.int64)], dim=1).to(parameter.device)

    def padded(features: torch.Tensor) -> torch.Tensor:
        features = features.to(device=parameter.device, dtype=parameter.dtype)
        return torch.nn.functional.pad(features, (0, 0, length - tokens, 0))

    with torch.inference_mode(), comfy_connector_rope(processor):
        video, audio, _ = processor.create_embeddings(padded(video_features), padded(audio_features), convert_to_additive_mask(mask, parameter.dtype))
    return TextContext(video_context=video, audio_context=audio)
