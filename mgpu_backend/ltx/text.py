"""Prompt encoding for LTX-2: Gemma hidden states -> the video and audio text contexts.

Same computation as the official pipeline's prompt encoding (without prompt enhancement): Gemma 3
runs each prompt on its own (padded to the tokenizer's fixed length) and returns the hidden states
of all its layers; Gemma is then let go, and the checkpoint's embeddings processor (feature
extractor + video and audio connectors) turns each prompt's hidden states into the two contexts
the transformer cross-attends to. The two halves are separate functions so that the fleet can run
Gemma where it fits and the small processor anywhere.

It runs inside a rank on whatever models the loader hands it; it never talks to other ranks (the
fleet decides which rank encodes and broadcasts the result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GemmaOutput = tuple[tuple[torch.Tensor, ...], torch.Tensor]
"""One prompt through Gemma: (hidden states of the embeddings and every layer, attention mask)."""


@dataclass(frozen=True)
class TextContext:
    """What one prompt conditions the transformer with: ``[1, tokens, dim]`` per modality."""

    video_context: torch.Tensor
    audio_context: torch.Tensor


def encode_prompts(loader, prompts: list[str]) -> list[TextContext]:
    """Encode every prompt; one ``TextContext`` per prompt, in order."""
    if not prompts:
        raise ValueError("no prompts to encode; pass at least one (an empty string is a valid prompt)")
    with torch.inference_mode():
        gemma = loader.gemma()
        gemma_outputs = [gemma.encode(prompt) for prompt in prompts]
        # Gemma is by far the largest text model: let it go before the processor is built.
        del gemma
    return contexts_from_gemma(loader, gemma_outputs)


def contexts_from_gemma(loader, gemma_outputs: list[GemmaOutput]) -> list[TextContext]:
    """The embeddings-processor half of ``encode_prompts``."""
    with torch.inference_mode():
        processor = loader.embeddings_processor()
        contexts = []
        for hidden_states, attention_mask in gemma_outputs:
            processed = processor.process_hidden_states(hidden_states, attention_mask)
            contexts.append(TextContext(video_context=processed.video_encoding, audio_context=processed.audio_encoding))
    return contexts
