"""The fleet's plan for ComfyUI's LTX-AV model refuses, in words and before any weight is loaded, code it
does not cover; the batch planner splits a call over groups of ranks only where SP degrees allow.

The refusals need ComfyUI's code (COMFYUI_DIR, see tests/comfy_model_cases.py) and skip without it.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.comfy_model import plan
from mgpu_backend.comfy_model.jobs import batch_groups
from mgpu_backend.fleet.jobs import JobInputError


def test_comfyui_v0_20_1_ltx_code_is_covered(comfy):
    plan.check_code()


def test_a_block_forward_with_another_signature_is_refused(comfy, monkeypatch):
    import comfy.ldm.lightricks.av_model as av_model

    def forward(self, x, v_context=None, a_context=None, attention_mask=None, transformer_options=None):
        return x

    monkeypatch.setattr(av_model.BasicAVTransformerBlock, "forward", forward)
    with pytest.raises(plan.PlanRefused, match=(
        r"this ComfyUI's LTX model has BasicAVTransformerBlock.forward\(self, x, v_context, a_context, attention_mask, "
        r"transformer_options\) where the plan expects \(self, x, v_context, .*\), which the fleet's plan does not cover; "
        r"supported: LTXAVModel of ComfyUI v0.20.1"
    )):
        plan.check_code()


def test_a_block_without_its_audio_to_video_attention_is_refused(comfy, monkeypatch):
    import comfy.ldm.lightricks.av_model as av_model

    built = av_model.BasicAVTransformerBlock.__init__

    def without_audio_to_video(self, *args, **kwargs):
        built(self, *args, **kwargs)
        del self.audio_to_video_attn

    monkeypatch.setattr(av_model.BasicAVTransformerBlock, "__init__", without_audio_to_video)
    with pytest.raises(plan.PlanRefused, match=(
        r"this ComfyUI's LTX model has no audio_to_video_attn \(video queries, audio keys\) in the block class, "
        r"which the fleet's plan does not cover"
    )):
        plan.check_code()


def test_an_attention_module_of_another_class_in_a_loaded_model_is_refused(comfy):
    import comfy.ops
    from comfy.ldm.lightricks.av_model import LTXAVModel

    model = LTXAVModel(
        in_channels=16, audio_in_channels=16, cross_attention_dim=32, audio_cross_attention_dim=16, attention_head_dim=8,
        audio_attention_head_dim=4, num_attention_heads=4, audio_num_attention_heads=4, caption_channels=16, num_layers=2,
        device="meta", operations=comfy.ops.disable_weight_init,
    )
    plan.check_model(model)
    model.transformer_blocks[1].attn2 = torch.nn.Identity()
    with pytest.raises(plan.PlanRefused, match=r"has a Identity as attn2 in block 1, not ComfyUI's CrossAttention"):
        plan.check_model(model)


@pytest.mark.parametrize(("batch", "world_size", "groups"), [(2, 2, 2), (2, 4, 2), (1, 4, 1), (3, 2, 1), (4, 8, 4), (2, 1, 1)])
def test_batch_groups_are_the_most_that_divide_batch_and_fleet(batch, world_size, groups):
    assert batch_groups(batch, world_size, [1, 2, 4, 8]) == groups


def test_a_fleet_whose_size_is_no_sp_degree_is_refused_in_words():
    with pytest.raises(JobInputError, match=r"a fleet of 3 ranks cannot run this model sequence-parallel \(SP degrees \[1, 2, 4, 8\]"):
        batch_groups(1, 3, [1, 2, 4, 8])
