"""The Gemma-3 folder of every bundle, as Hugging Face lays it out, and the tokenizer trained for it.

Everything in the folder but the weights and their index: config.json (the bundle's Gemma
configuration), tokenizer.model (a SentencePiece BPE model trained here on the prompt-like text
below) and its fast-tokenizer twin tokenizer.json, the tokenizer, processor and generation
configs. The same tokenizer serves every Gemma size: its 640 pieces are valid ids in any Gemma
vocabulary, and ltx-core pads every prompt to 1024 tokens whatever the vocabulary.

Bytes are deterministic (JSON with sorted keys, a single-threaded trainer). This module never
downloads anything.
"""

from __future__ import annotations

import io
import json

# SentencePiece ids of the Gemma special tokens in the tiny vocabulary (Gemma's own order for the
# first four; the trainer places user-defined symbols right after them).
_SPECIAL_PIECES = ("<pad>", "<eos>", "<bos>", "<unk>")
_USER_SYMBOLS = (
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
TOKEN_ID = {piece: i for i, piece in enumerate(_SPECIAL_PIECES + _USER_SYMBOLS)}
TOKENIZER_VOCAB_SIZE = 640

# Prompt-like text the tokenizer is trained on.
TOKENIZER_CORPUS = """\
A slow camera push toward a lighthouse on a rocky coast at dusk, waves breaking against the stones.
A woman in a red coat walks through a crowded market, the camera tracking her from behind.
Close-up of a cat sleeping on a windowsill while rain runs down the glass.
An aerial shot of a winding mountain road with a single car driving through the autumn forest.
A chef chops vegetables in a busy kitchen; steam rises from the pots and a pan sizzles.
Two children laugh as they run across a green field chasing a kite in the wind.
The city skyline at night, traffic lights streaking below, distant sirens and a low hum of engines.
A musician plays an acoustic guitar on a small stage under warm yellow light.
A drone flies over a calm lake at sunrise, mist drifting over the water and birds calling.
An old man reads a newspaper on a park bench as pigeons gather at his feet.
A train crosses a long bridge over a river valley, the sound of wheels on the rails.
Snow falls softly on a quiet village street lined with wooden houses and glowing windows.
A dog shakes water off its fur on the beach, then sprints toward the waves.
A scientist looks through a microscope in a bright laboratory filled with glass bottles.
Fireworks explode over a harbor, reflections shimmering on the dark water, the crowd cheering.
A dancer spins in an empty studio, her shadow stretching across the polished floor.
Heavy rain on a tin roof, thunder rolling in the distance, a lamp flickering inside.
A close shot of hands kneading bread dough on a floured wooden table.
A cyclist rides down a narrow street in the old town, bells ringing from a church tower.
A sailboat glides across the open sea, the sail filling with wind under a clear blue sky.
The camera slowly pans across a desert at noon; heat waves rise from the sand dunes.
A barista pours milk into a cup of coffee, drawing a leaf pattern in the foam.
Leaves fall from tall trees in a quiet park while a jogger passes along the path.
A robot arm assembles small parts on a factory line with precise and steady movements.
A family shares dinner around a long table, talking and passing plates of food.
Lightning flashes over a wheat field as dark clouds roll across the horizon.
A fox steps carefully through fresh snow at the edge of a pine forest.
A young man plays the piano in a dim room; the melody is soft and slow.
Waves of people cross a wide street at a busy intersection in the morning.
A hot air balloon rises above green hills, its burner roaring at regular intervals.
Static camera, medium shot: a woman speaks to the camera and smiles, saying hello and welcome.
Wide shot, golden hour: horses gallop across an open plain, dust rising behind them.
Handheld camera follows a skateboarder down a concrete ramp; wheels clatter and scrape.
Macro shot of a bee landing on a purple flower, wings buzzing in the warm sunlight.
A candle burns on a wooden table; the flame moves gently in a light draft.
A street performer juggles three red balls while a small crowd claps along.
An astronaut floats inside a space station, looking out of a round window at the earth.
A waterfall pours into a clear pool surrounded by moss covered rocks and ferns.
The camera dollies forward through a library with tall shelves full of old books.
A painter adds bright strokes of blue and orange to a large canvas in a sunny studio.
Numbers and time: 1 2 3 4 5 6 7 8 9 0, 24 frames per second, 1080p, 4K, 16:9.
Sound: birds singing, wind blowing, water flowing, footsteps on gravel, a door closing.
"""

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

WEIGHTS_NAME = "model-00001-of-00001.safetensors"


def json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _train_sentencepiece() -> bytes:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_CORPUS.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=list(_USER_SYMBOLS),
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def _tokenizer_json(sentencepiece_model: bytes) -> bytes:
    """The fast-tokenizer twin of the SentencePiece model, laid out as Gemma's tokenizer.json is
    (normalizer space -> "▁", BPE with byte fallback, merges ranked by the merged piece's id, <bos> first)."""
    import sentencepiece
    import tokenizers
    from tokenizers import decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    processor = sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model)
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    merges = []
    for piece, piece_id in vocab.items():
        if not processor.is_control(piece_id) and not processor.is_byte(piece_id):
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((piece_id, vocab[left], vocab[right], left, right))
    merges.sort()
    tokenizer = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in merges],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", TOKEN_ID["<bos>"])]
    )
    tokenizer.add_special_tokens([tokenizers.AddedToken(piece, special=True, normalized=False) for piece in TOKEN_ID])
    return tokenizer.to_str(pretty=True).encode("utf-8")




def side_files(gemma: dict) -> dict[str, bytes]:
    """Every file of a Gemma folder for the configuration ``gemma`` (a config.json) but the weights
    and their index: the same tokenizer for every configuration, image sizes from its vision tower."""
    sentencepiece_model = _train_sentencepiece()
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    extra_special = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    added_tokens_decoder = {
        str(token_id): {
            "content": piece,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for piece, token_id in TOKEN_ID.items()
    }
    tokenizer_config = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": 1000000000000000019884624838656,
        "padding_side": "left",
        "added_tokens_decoder": added_tokens_decoder,
        "extra_special_tokens": extra_special,
        "chat_template": _CHAT_TEMPLATE,
        "processor_class": "Gemma3Processor",
        **special,
        **extra_special,
    }
    image_size, image_tokens = gemma["vision_config"]["image_size"], gemma["mm_tokens_per_image"]
    preprocessor_config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": image_tokens,
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size},
    }
    # The tokenizer's ids, not the configuration's: the tokenizer is this one whatever the Gemma size.
    eos_token_ids = [TOKEN_ID["<eos>"], TOKEN_ID["<end_of_turn>"]]
    return {
        "config.json": json_bytes(gemma),
        "generation_config.json": json_bytes({"bos_token_id": TOKEN_ID["<bos>"], "eos_token_id": eos_token_ids, "pad_token_id": 0}),
        "tokenizer.model": sentencepiece_model,
        "tokenizer.json": _tokenizer_json(sentencepiece_model),
        "tokenizer_config.json": json_bytes(tokenizer_config),
        "special_tokens_map.json": json_bytes({**special, **extra_special}),
        "preprocessor_config.json": json_bytes(preprocessor_config),
        "processor_config.json": json_bytes({"image_seq_length": image_tokens, "processor_class": "Gemma3Processor"}),
    }


def index_bytes(tensor_bytes: dict[str, int]) -> bytes:
    """model.safetensors.index.json for the one weights file holding ``tensor_bytes`` (key -> bytes)."""
    return json_bytes(
        {
            "metadata": {"total_size": sum(tensor_bytes.values())},
            "weight_map": {key: WEIGHTS_NAME for key in sorted(tensor_bytes)},
        }
    )
