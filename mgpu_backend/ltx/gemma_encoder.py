"""Gemma-3 as LTX-2 reads it: prompt -> hidden states of the embeddings and every layer, on transformers 4.52+ and 5.x.

What it is
    LTX-2 never uses Gemma's logits, its vision tower or its chat processor for a prompt: it needs
    the hidden states of Gemma's text stack for the prompt padded to 1024 tokens. ``GemmaEncoder``
    holds exactly that: transformers' own ``Gemma3TextModel`` (the model code stays transformers')
    and a tokenizer, and ``encode(prompt)`` returns ``(hidden_states, attention_mask)`` as
    ltx-core's ``GemmaTextEncoder.encode`` does. Without the vision tower and the tied lm_head it
    also holds about 2 GB less at 12B.

Why not ltx-core's Gemma wrapper
    ltx-core 1.0.0 builds ``Gemma3ForConditionalGeneration`` on the meta device and then fills the
    buffers the checkpoint lacks by hand (``create_and_populate`` in
    ``ltx_core/text_encoders/gemma/encoders/encoder_configurator.py``), naming transformers 4.x
    internals that transformers 5 renamed: ``vision_tower.vision_model`` (5.x: the vision tower IS
    the vision model), ``language_model.rotary_emb_local`` (5.x: one ``rotary_emb`` holding
    ``full_attention_inv_freq`` and ``sliding_attention_inv_freq``), ``config.rope_scaling`` and
    ``rope_local_base_freq`` (5.x: ``config.rope_parameters`` per layer type). The first of these
    raises ``AttributeError`` on 5.x. Here those buffers are computed by transformers itself: each
    rotary-embedding module is rebuilt on the CPU from its own config, so whatever the version
    calls them, they hold what that version computes, in float32 as on a normal load.

    Under transformers 4.x this gives bitwise the hidden states of ltx-core's wrapper (so of
    ltx-pipelines), and under 5.x bitwise those of 4.x (tests/test_gemma_transformers.py).

Tokenizers: a Gemma folder's own Hugging Face tokenizer (ltx-core's ``LTXVGemmaTokenizer``, which
works on both versions), or the SentencePiece model ComfyUI embeds in its single file
(``gemma_file.SentencePieceGemmaTokenizer``), both giving ``<bos>`` + tokens left-padded to 1024.

Never edits ltx-core or transformers; never downloads anything.
"""

from __future__ import annotations

import torch
from ltx_core.loader.sd_ops import SDOps

GEMMA_MAX_TOKENS = 1024
"""Every prompt is padded (left) or truncated to this many tokens, as in ltx-core."""

GEMMA_FOLDER_KEY_OPS = (
    SDOps("GEMMA_FOLDER_TEXT_KEY_OPS")
    # Google's release (and ltx-core) name the text stack language_model.model.*; transformers 4.52+
    # saves it as model.language_model.*. Vision tower, projector and the tied lm_head stay out.
    .with_matching(prefix="language_model.model.")
    .with_replacement("language_model.model.", "model.")
    .with_matching(prefix="model.language_model.")
    .with_replacement("model.language_model.", "model.")
)
"""A Gemma folder's text-stack keys -> ``GemmaEncoder``'s (``model.layers.0.self_attn.q_proj.weight``)."""

ATTENTION_IMPLEMENTATION = "sdpa"
"""Fixed so that a transformers upgrade that changes the default cannot change the encodings."""


class GemmaEncoder(torch.nn.Module):
    """Gemma-3's text stack and its tokenizer: ``encode(prompt)`` -> (hidden states, attention mask)."""

    def __init__(self, model: torch.nn.Module, tokenizer=None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def encode(self, text: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The hidden states of the embeddings and every layer (the last one after the final norm)
        for ``text`` and the attention mask of its padded tokens, both ``[1, 1024, ...]``."""
        token_pairs = self.tokenizer.tokenize_with_weights(text)["gemma"]
        input_ids = torch.tensor([[int(token) for token, _ in token_pairs]], device=self.device)
        attention_mask = torch.tensor([[int(weight) for _, weight in token_pairs]], device=self.device)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return tuple(outputs.hidden_states), attention_mask


def text_model_on_meta(text_config: dict) -> torch.nn.Module:
    """transformers' ``Gemma3TextModel`` for ``text_config`` (a Gemma ``text_config`` dict), on the meta device."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextModel

    config = Gemma3TextConfig.from_dict(dict(text_config))
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    with torch.device("meta"):
        return Gemma3TextModel(config)


def encoder_configurator(text_config: dict) -> type:
    """An ltx-core model configurator building an empty ``GemmaEncoder`` for ``text_config``."""

    class GemmaEncoderConfigurator:
        @classmethod
        def from_config(cls, config: dict) -> GemmaEncoder:  # noqa: ARG003 - Gemma weights carry no config
            return GemmaEncoder(text_model_on_meta(text_config))

    return GemmaEncoderConfigurator


def materialize_buffers(encoder: GemmaEncoder) -> GemmaEncoder:
    """Give the meta-built model the buffers a checkpoint never holds, computed by transformers itself.

    The rotary embeddings are rebuilt on the CPU from the config each one keeps (transformers 4.x has
    two modules, the local one with its own config; 5.x one module with a buffer per layer type); the
    embedding scale is sqrt(hidden size) in float32, as ``Gemma3TextScaledWordEmbedding`` makes it.
    """
    model = encoder.model
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device("cpu"):
                rebuilt = type(module)(config=module.config)
            _replace_module(model, name, rebuilt)
    embed = model.embed_tokens
    embed.register_buffer("embed_scale", torch.tensor(model.config.hidden_size**0.5), persistent=False)
    still_meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if still_meta:
        raise RuntimeError(
            f"this transformers version's Gemma3TextModel has buffers the loader does not know how to fill: {still_meta}; "
            "use a transformers version between 4.52 and the newest 5.x this pack was tested with"
        )
    return encoder


def _replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def encoder_module_ops(tokenizer_factory) -> tuple:
    """ltx-core module ops for a ``GemmaEncoder``: fill its buffers, then attach ``tokenizer_factory()``."""
    from ltx_core.loader.module_ops import ModuleOps

    def attach_tokenizer(encoder: GemmaEncoder) -> GemmaEncoder:
        encoder.tokenizer = tokenizer_factory()
        return encoder

    return (
        ModuleOps("GemmaEncoderBuffers", matcher=lambda module: isinstance(module, GemmaEncoder), mutator=materialize_buffers),
        ModuleOps(
            "GemmaEncoderTokenizer",
            matcher=lambda module: isinstance(module, GemmaEncoder) and module.tokenizer is None,
            mutator=attach_tokenizer,
        ),
    )


def folder_tokenizer(gemma_root: str):
    """The Gemma folder's own Hugging Face tokenizer, set up as ltx-core sets it up."""
    from ltx_core.text_encoders.gemma.tokenizer import LTXVGemmaTokenizer
    from ltx_core.utils import find_matching_file

    return LTXVGemmaTokenizer(str(find_matching_file(gemma_root, "tokenizer.model").parent), GEMMA_MAX_TOKENS)
