#!/usr/bin/env python3
"""Regenerate everything under testdata/: a small byte-level BPE tokenizer, five tiny random Qwen3.5 checkpoints,
Hugging Face transformers goldens (f32 and f64) for each, an fla naive-kernel golden, and testdata/manifest.json.

Run from anywhere with the interpreter of a venv made from scripts/requirements.txt:

    .venv/bin/python scripts/make_testdata.py

Deterministic: fixed seeds, one CPU thread, no downloads. flash-linear-attention (`fla`) is made invisible to this
process (transformers would otherwise silently swap its gated-delta-rule kernels); the fla golden is made by
scripts/fla_check.py in a child process.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------------------------------
# 1. Hide `fla` (and hub kernels / causal-conv1d) from this process before transformers is imported.
#    Every meta-path finder is wrapped so that these names are simply "not installed": importlib.util.find_spec
#    returns None and `import fla` raises ModuleNotFoundError.
# ------------------------------------------------------------------------------------------------------------------
import importlib.abc
import sys

BLOCKED_MODULES = ("fla", "kernels", "causal_conv1d")


def _is_blocked(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in BLOCKED_MODULES)


class _HidingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if _is_blocked(name):
            return None
        find = getattr(self._inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def invalidate_caches(self):
        inv = getattr(self._inner, "invalidate_caches", None)
        if inv is not None:
            inv()

    def __getattr__(self, attr):  # find_distributions etc. (importlib.metadata keeps working)
        return getattr(self._inner, attr)


def _hide_blocked_modules() -> None:
    loaded = [m for m in sys.modules if _is_blocked(m)]
    if loaded:
        raise RuntimeError(f"modules imported before the blocker was installed: {loaded}")
    sys.meta_path[:] = [f if isinstance(f, _HidingFinder) else _HidingFinder(f) for f in sys.meta_path]


_hide_blocked_modules()

import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from testdata_files import canonicalize_safetensors_header, rel, sha256, write_json  # noqa: E402

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers.models import BPE  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling  # noqa: E402
from transformers.models.qwen3_5.configuration_qwen3_5 import (  # noqa: E402
    Qwen3_5Config,
    Qwen3_5TextConfig,
)

REPO = Path(__file__).resolve().parent.parent
TESTDATA = REPO / "testdata"
SCRIPTS = REPO / "scripts"

# ------------------------------------------------------------------------------------------------------------------
# 2. Fixed inputs: corpus, special tokens, chat template, prompts, model specs, seeds
# ------------------------------------------------------------------------------------------------------------------

# A few KB of plain English written for this file; the BPE is trained on it and nothing else.
CORPUS = """\
The river begins as a thin stream high in the hills, where snow melts slowly in the spring. It runs over stones and
under old bridges, and by the time it reaches the town it is wide enough to carry small boats. People who live near the
water learn to read it. When the river is brown and fast, the rain has been heavy in the north. When it is clear and
quiet, the summer has come, and children swim in the shallow places near the mill.

A good kitchen is a place of small habits. The cook keeps the knives sharp, the salt within reach, and the pans clean.
Bread needs flour, water, salt and time; the time matters more than most people think. A slow dough left overnight in a
cool room has a deeper taste than a quick one. Soup is the same: onions cooked gently until they are soft and sweet
give the whole pot its character. Nothing here is difficult, but all of it asks for patience.

The old library in the center of the city has tall windows and long tables. Students come in the morning with their
notes and stay until the light fades. The books on the top shelves are rarely read, and some of them have not been
opened for many years. A quiet librarian walks between the rows, returning lost volumes to their places and answering
questions in a soft voice. She believes that every question deserves a careful answer, even a simple one.

Weather changes the way a day feels. A grey morning with low clouds makes the streets seem narrow, while a bright
afternoon opens them up. In autumn the wind carries leaves across the square, and in winter the first frost draws
white lines on the windows. Farmers watch the sky more closely than anyone else, because a late frost or a dry month
can decide the size of the harvest. They plant, they wait, and they hope the rain will come at the right time.

Learning a new skill is rarely a straight line. At first everything is strange, and small mistakes feel large. After a
while the hands and the mind begin to remember, and the work becomes lighter. A musician repeats the same few bars many
times before they sound natural. A painter mixes colors again and again until the green of a field looks right. The
secret, if there is one, is to keep going on the days when progress seems slow.

A train leaves the station at seven in the morning and follows the coast to the south. From the window you can see
fishing boats, white houses on the hills, and long beaches that are empty in the early hours. The journey takes most of
the day. Some travelers read, some sleep, and some simply watch the sea. When the train finally stops, the air is
warmer and smells of salt and pine trees.

Computers follow instructions exactly, which is both their strength and their weakness. A program that adds two
numbers will add them correctly a million times, but a single wrong sign in the code can send every answer in the
wrong direction. Good engineers test their work with small examples first. They compare the results with a simple
reference that they trust, and they change only one thing at a time, so that when something breaks they know why.

The system answers the user with care. The assistant reads the question, thinks about what the user needs, and writes
a short, clear reply. If the question is unclear, the assistant asks for more details. If the answer is long, it is
split into steps. Every reply should be honest, helpful and easy to read.

In the garden, the tomatoes are ready in late summer, and the beans climb the fence by the gate. Bees move from flower
to flower all afternoon. In the evening the soil is watered, and the smell of wet earth rises from the beds. A garden
teaches that growth is slow and that small daily care adds up to something large.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # added, special=true
THINK_TOKENS = ["<think>", "</think>"]  # added, special=false (as in Qwen3 / Qwen3.5)
BPE_VOCAB_SIZE = 507  # 256 byte symbols + 251 merges; the 5 added tokens come on top (ids 507..511)

# Same output form as Qwen3.5's template for plain text messages; written for this project. Only features minijinja
# supports: no Python string methods, no raise_exception. Thinking is on unless enable_thinking is passed as false.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content | trim) + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Qwen3.5's own pre-tokenizer regex (the same string transformers' Qwen3_5Tokenizer builds).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

PROMPTS = {
    "tiny": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": (
                    "Every spring the river in our town rises when the snow melts in the hills, and last year the "
                    "water came up to the old mill. Why does the river change so much?"
                ),
            },
        ],
        "chat_template_kwargs": {},  # Qwen3.5's default: thinking on
    },
    "tiny-tied": {
        "messages": [
            {"role": "system", "content": "You are a patient cooking teacher."},
            {
                "role": "user",
                "content": (
                    "I want to bake bread. I have flour, water, salt and yeast, but my kitchen is cool in the "
                    "morning. How long should the dough rest?"
                ),
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "tiny-full": {
        "messages": [
            {"role": "system", "content": "You are a careful engineer."},
            {
                "role": "user",
                "content": (
                    "Our program adds numbers from a long list, and on some days the answer is wrong by a small "
                    "amount. We changed two things last week. Which change broke it?"
                ),
            },
        ],
        "chat_template_kwargs": {"enable_thinking": True},
    },
    "tiny-h128": {
        "messages": [
            {"role": "system", "content": "You are a quiet music teacher."},
            {
                "role": "user",
                "content": (
                    "Every evening I repeat the same few bars on the piano, but after a week my hands still feel "
                    "slow. Should I play faster now, or keep going slowly for a while?"
                ),
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "tiny-corr": {
        "messages": [
            {"role": "system", "content": "You are a calm guide on a coast train."},
            {
                "role": "user",
                "content": (
                    "The morning train to the south is late again, and the rain makes the sea look grey from the "
                    "window. Should we wait for it, or take the bus?"
                ),
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "tiny-decay": {
        "messages": [
            {"role": "system", "content": "You are a patient gardener."},
            {
                "role": "user",
                "content": (
                    "The tomatoes by the south wall grew tall in June, but their leaves turned yellow after the "
                    "heavy rain. The beans next to them look fine. What should I change?"
                ),
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
}
PROMPT_LEN_RANGE = (100, 160)
NUM_GENERATED = 16

ROPE_SECTION_NOTE = "mrope_section sums to rotary_dim/2 (rotary_dim = head_dim * partial_rotary_factor)"

MODEL_SPECS = {
    "tiny": {
        "format": "text",
        "seed": 1000,
        "text": dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    },
    "tiny-tied": {
        "format": "text",
        "seed": 2000,
        "drop_layer_types_for_interval": 2,  # config.json gets full_attention_interval: 2 and no layer_types
        # tied: the input embedding is also the output head, so the layers must move the residual stream further
        # away from the current token's embedding, or greedy decoding just repeats the last token
        "init": dict(out_gain=2.5, attn_out_gain=6.0, down_gain=2.5),
        "text": dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    },
    "tiny-full": {
        "format": "full",
        "seed": 3000,
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=8,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "vision": dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=16,
        ),
    },
    # The real model's DeltaNet head dims (Dk = Dv = 128, two value heads per key head) and its small DeltaNet output
    # (SPEC "fp16 precision of the DeltaNet output"): the value rows of in_proj_qkv are scaled per value head so that
    # the RMS of `core_output` over the prompt spans 1e-3..2e-2 as in Qwen3.5-9B. bf16 keeps the checkpoint small.
    "tiny-h128": {
        "format": "text",
        "seed": 6000,
        "weights_dtype": "bfloat16",
        "core_output_rms": dict(
            targets=(1.25e-3, 1.5e-2),  # per (layer, value head) targets, log-spaced over this range and shuffled
            accept=(1.0e-3, 2.0e-2),  # every head's RMS must be in here
            smallest_at_most=2.0e-3,  # and some heads near 1e-3 ...
            largest_at_least=1.0e-2,  # ... and some near 1e-2
        ),
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[3, 3, 2],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    },
    # Correlated keys, weak decay, a nearly constant write strength (see `correlate_keys`): the matrix N =
    # tril(beta k k^T * decay) of a 64-token block is then coherent enough that the series (I - N)(I + N^2)... for
    # (I + N)^-1 passes through entries of about 1.5e3 before it cancels down to entries below 0.3: fp16 cannot carry
    # that cancellation, f32 can; block doubling never forms such terms. The real head dims
    # (Dk = Dv = 128); to keep the goldens small: one key and one value head, three layers [L L F], two query heads;
    # bf16.
    "tiny-corr": {
        "format": "text",
        "seed": 7000,
        "weights_dtype": "bfloat16",
        "correlated_keys": dict(
            constant_channel=0,  # the residual stream's channel that is the same for every token
            constant_value=4.0,  # its value (every embedding has it; no layer writes to it)
            key_shared_gain=3.0,  # the shared key direction's weight on that channel (other weights N(0, 1/fan_in))
            decay_centre=1.0e-3,  # -g = exp(A_log) softplus(a + dt_bias) centred here: exp(g) about 0.999
            growth_block=64,  # the block whose series is measured (the first 64 prompt tokens)
            growth_target=1.5e3,  # largest entry of any intermediate of the series (I - N)(I + N^2)... at that block
            growth_accept=(1.2e3, 1.9e3),  # after bf16 rounding and with the final weights
        ),
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[3, 3, 2],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    },
    # Strong and almost no decay side by side (SPEC "Chunked forms"): per (layer, value head) the centre of
    # -g = exp(A_log) softplus(a + dt_bias) is log-spaced over 1e-4..25 and the per-token spread (a_gain) is
    # the other models', so g spans about -60..0 per token: some heads forget everything but the current token
    # (exp(g) below 1e-20, a block's exp(G) underflows to zero in f32), others keep almost all of their state.
    # Where exp(g) is that small, G_t - G_j written as the difference of two cumulative sums of about 10^3 is off by
    # about |G| 2^-24 absolute (transformers' f32 chunked kernel does this; the reference sums the segment).
    "tiny-decay": {
        "format": "text",
        "seed": 8000,
        "weights_dtype": "bfloat16",
        "decay_centre_range": (1.0e-4, 25.0),
        "strong_decay": dict(
            g_min_accept=(-70.0, -50.0),  # the strongest decay of any token, per token
            g_max_at_least=-1.0e-3,  # and a head that hardly decays at all
        ),
        "text": dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    },
}
COMMON_TEXT = dict(hidden_act="silu", max_position_embeddings=2048, attention_bias=False, use_cache=True)

# Re-initialisation (SPEC "Oracles": a default-initialised model is degenerate). Std values are for N(0, std) unless
# said; "/fan" means divided by sqrt(fan_in).
INIT = dict(
    embed_std=1.0,  # embeddings
    norm_std=0.2,  # zero-centred RMSNorm weights (input/post-attention/final/q_norm/k_norm): N(0, 0.2)
    gated_norm_std=0.2,  # gated norm weight: 1 + N(0, 0.2)
    conv_std=0.5,  # depthwise conv1d weights
    in_gain=1.0,  # in_proj_qkv / in_proj_z, q/k/v_proj, gate/up_proj: gain/fan
    b_gain=1.5,  # in_proj_b: beta = sigmoid(b) spread over (0, 1)
    a_gain=0.5,  # in_proj_a: per-token spread of the decay around the head's centre
    out_gain=1.0,  # linear_attn.out_proj: gain/fan
    attn_out_gain=3.0,  # self_attn.o_proj: gain/fan (softmax averaging shrinks the attention output)
    down_gain=1.0,  # mlp.down_proj: gain/fan
    lm_head_gain=8.0,  # lm_head: gain/fan (logits std about 8)
)
# Per (linear layer, value head) centre of -g = exp(A_log) * softplus(a + dt_bias): log-spaced over this range and
# shuffled, so exp(g) spans about 0.01 .. 0.99999 over the prompt.
DECAY_CENTRE_RANGE = (2.0e-5, 2.5)
DT_BIAS_RANGE = (-1.0, 1.0)

MIN_MARGIN = 1e-2  # top1 - top2 logit, over the prompt and over the greedy steps
RATIO_RANGE = (0.1, 2.0)  # ||mixer_out|| / ||residual in|| and ||mlp_out|| / ||residual in||
MIN_DISTINCT_GENERATED = 8  # a greedy continuation that repeats one token tests little of the decode path
MAX_ATTEMPTS = 64
FLA_SEED = 4000
# What this script writes (models/, goldens/, the tokenizer files; the later scripts' goldens and sets come on top).
# 16 MB until tiny-decay (about 2.5 MB) joined.
MAX_TESTDATA_BYTES = 20_000_000

# Models with a `core_output_rms` spec: at most this many forward passes to bring every value head's core_output RMS
# within CALIBRATION_TOL (relative) of its target.
CALIBRATION_PASSES = 8
CALIBRATION_TOL = 0.01
# The prompt block over which every model's series figures are measured (the NPU port's block).
SERIES_BLOCK = 64
# fp16: smallest normal 2^-14 (about 6.1e-5) and smallest subnormal 2^-24 (about 6.0e-8; half of it rounds to zero)
FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24

# ------------------------------------------------------------------------------------------------------------------
# 3. Helpers
# ------------------------------------------------------------------------------------------------------------------


def log(msg: str = "") -> None:
    print(msg, flush=True)


def dist_version(name: str) -> str:
    return importlib.metadata.version(name)


def set_determinism() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


# ------------------------------------------------------------------------------------------------------------------
# 4. The no-fla assertion: the modeling module must end up calling its own torch kernels
# ------------------------------------------------------------------------------------------------------------------

KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
KERNEL_CALLS = {name: 0 for name in KERNEL_FUNCS}


def assert_torch_kernels_and_count_calls() -> dict:
    """Check that each kernel wrapper in modeling_qwen3_5 dispatches to the module's own torch function, then swap
    the dispatch target for a counting shim around that same function (so the goldens prove at run time that the
    torch path ran)."""
    for name in BLOCKED_MODULES:
        assert name not in sys.modules, f"{name} got imported"
        assert importlib.util.find_spec(name) is None, f"{name} is visible to this process"
    report = {}
    for name in KERNEL_FUNCS:
        wrapper = getattr(modeling, name)
        torch_fn = wrapper.__wrapped__
        assert torch_fn.__module__ == modeling.__name__ and torch_fn.__name__ == name, (name, torch_fn)
        freevars = wrapper.__code__.co_freevars
        cells = dict(zip(freevars, wrapper.__closure__))
        impl = cells["implementation"].cell_contents
        assert impl is torch_fn, f"{name} dispatches to {impl!r} ({inspect.getmodule(impl)}), not the torch function"
        assert cells["is_new_implementation"].cell_contents is False, name

        def counting(*args, __fn=torch_fn, __name=name, **kwargs):
            KERNEL_CALLS[__name] += 1
            return __fn(*args, **kwargs)

        cells["implementation"].cell_contents = counting
        report[name] = f"{torch_fn.__module__}.{torch_fn.__qualname__}"
    return report


# ------------------------------------------------------------------------------------------------------------------
# 5. Tokenizer
# ------------------------------------------------------------------------------------------------------------------


def build_tokenizer(out_dir: Path) -> dict:
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB_SIZE, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    tok.save(str(out_dir / "tokenizer.json"))

    added_decoder = {}
    for t in SPECIAL_TOKENS + THINK_TOKENS:
        added_decoder[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", config)
    return {
        "vocab_size": vocab_size,
        "bpe_vocab_size": BPE_VOCAB_SIZE,
        "added_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS},
        "corpus_bytes": len(CORPUS.encode("utf-8")),
    }


def render_prompt(hf_tok, name: str) -> tuple[str, list[int]]:
    p = PROMPTS[name]
    text = hf_tok.apply_chat_template(
        p["messages"], tokenize=False, add_generation_prompt=True, **p["chat_template_kwargs"]
    )
    ids = hf_tok.apply_chat_template(
        p["messages"], tokenize=True, add_generation_prompt=True, return_dict=False, **p["chat_template_kwargs"]
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    return text, ids


def check_tokenizer(tok_dir: Path) -> dict:
    """Load with AutoTokenizer; check the template's two thinking forms and that the HF tokenizer and the raw
    tokenizers.Tokenizer (what the Rust side loads) give the same ids."""
    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    on_default = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    on = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    no_gen = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    base = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert no_gen == base, repr(no_gen)
    assert on_default == on == base + "<|im_start|>assistant\n<think>\n", repr(on_default)
    assert off == base + "<|im_start|>assistant\n<think>\n\n</think>\n\n", repr(off)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    assert len(hf_tok) == raw.get_vocab_size(with_added_tokens=True)
    extra = [CORPUS, "Numbers 12345, 3.14 and    spaces\n\n\ttabs; café naïve 東京 🙂 <think>x</think><|im_end|>"]
    for s in extra:
        assert hf_tok(s, add_special_tokens=False)["input_ids"] == raw.encode(s, add_special_tokens=False).ids
        assert raw.decode(raw.encode(s, add_special_tokens=False).ids, skip_special_tokens=False) == s
    for name in PROMPTS:
        text, ids = render_prompt(hf_tok, name)
        raw_ids = raw.encode(text, add_special_tokens=False).ids
        assert ids == raw_ids, f"{name}: HF and raw tokenizer ids differ"
        assert hf_tok(text, add_special_tokens=True)["input_ids"] == raw_ids, f"{name}: add_special_tokens adds ids"
        assert raw.decode(raw_ids, skip_special_tokens=False) == text, f"{name}: decode does not round-trip"
        for t in SPECIAL_TOKENS + THINK_TOKENS:
            if t in text:
                assert raw.token_to_id(t) in raw_ids, f"{name}: {t} not a single token"
    return {"class": type(hf_tok).__name__, "template_default_thinking": True}


# ------------------------------------------------------------------------------------------------------------------
# 6. Models: config, re-initialisation, checkpoint writing
# ------------------------------------------------------------------------------------------------------------------


def make_config(spec: dict, vocab_size: int, special_ids: dict):
    text_kwargs = dict(COMMON_TEXT)
    text_kwargs.update(spec["text"])
    text_kwargs.update(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=special_ids["<|endoftext|>"],
        pad_token_id=special_ids["<|endoftext|>"],
    )
    rp = text_kwargs["rope_parameters"]
    rotary_dim = int(text_kwargs["head_dim"] * rp["partial_rotary_factor"])
    assert sum(rp["mrope_section"]) * 2 == rotary_dim, (ROPE_SECTION_NOTE, rp, rotary_dim)
    if spec["format"] == "text":
        return Qwen3_5TextConfig(**text_kwargs)
    return Qwen3_5Config(
        text_config=dict(model_type="qwen3_5_text", **text_kwargs),
        vision_config=dict(model_type="qwen3_5_vision", **spec["vision"]),
        tie_word_embeddings=text_kwargs["tie_word_embeddings"],
    )


def weights_dtype_of(spec: dict) -> str:
    """The dtype of the written checkpoint: tiny-full is bf16 like a real checkpoint; a flat model may ask for bf16."""
    return spec.get("weights_dtype", "bfloat16" if spec["format"] == "full" else "float32")


def text_config_of(config):
    return config.text_config if hasattr(config, "text_config") else config


def decoder_of(model):
    """The text decoder module (embed_tokens, layers, norm)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def new_model(spec: dict, config):
    cls = (
        transformers.Qwen3_5ForCausalLM if spec["format"] == "text" else transformers.Qwen3_5ForConditionalGeneration
    )
    model = cls(config)
    return model.eval()


@torch.no_grad()
def reinit(model, config, seed: int, overrides: dict | None = None,
           decay_centre_range: tuple[float, float] = DECAY_CENTRE_RANGE, mlp_init=None) -> dict:
    """Give the decoder non-degenerate weights (see INIT). The vision tower keeps transformers' default init.
    `mlp_init(mlp, normal_, linear_, init)` draws a layer's feed-forward block in place of the dense MLP's draws
    (make_moe_goldens.py's MoE blocks), in the same place of the sequence of draws."""
    init = dict(INIT, **(overrides or {}))
    tc = text_config_of(config)
    gen = torch.Generator().manual_seed(seed)
    dec = decoder_of(model)

    def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    def linear_(lin, gain: float) -> None:
        normal_(lin.weight, gain / math.sqrt(lin.weight.shape[1]))

    normal_(dec.embed_tokens.weight, init["embed_std"])
    lin_heads = []
    for i, layer in enumerate(dec.layers):
        normal_(layer.input_layernorm.weight, init["norm_std"])
        normal_(layer.post_attention_layernorm.weight, init["norm_std"])
        if tc.layer_types[i] == "linear_attention":
            la = layer.linear_attn
            linear_(la.in_proj_qkv, init["in_gain"])
            linear_(la.in_proj_z, init["in_gain"])
            linear_(la.in_proj_b, init["b_gain"])
            linear_(la.in_proj_a, init["a_gain"])
            normal_(la.conv1d.weight, init["conv_std"])
            normal_(la.norm.weight, init["gated_norm_std"], mean=1.0)
            linear_(la.out_proj, init["out_gain"])
            lin_heads += [(i, h) for h in range(la.num_v_heads)]
        else:
            sa = layer.self_attn
            for lin in (sa.q_proj, sa.k_proj, sa.v_proj):
                linear_(lin, init["in_gain"])
            normal_(sa.q_norm.weight, init["norm_std"])
            normal_(sa.k_norm.weight, init["norm_std"])
            linear_(sa.o_proj, init["attn_out_gain"])
        if mlp_init is not None:
            mlp_init(layer.mlp, normal_, linear_, init)
            continue
        linear_(layer.mlp.gate_proj, init["in_gain"])
        linear_(layer.mlp.up_proj, init["in_gain"])
        linear_(layer.mlp.down_proj, init["down_gain"])
    normal_(dec.norm.weight, init["norm_std"])
    if not tc.tie_word_embeddings:
        linear_(model.lm_head, init["lm_head_gain"])
    else:
        assert model.lm_head.weight.data_ptr() == dec.embed_tokens.weight.data_ptr(), "lm_head is not tied"

    # Decay: centre of -g per (layer, head), log-spaced over the range (DECAY_CENTRE_RANGE unless the model says) and
    # shuffled across heads/layers.
    lo, hi = (math.log(x) for x in decay_centre_range)
    n = len(lin_heads)
    centres = torch.exp(torch.linspace(lo, hi, n, dtype=torch.float64))
    perm = torch.randperm(n, generator=gen)
    for (i, h), c in zip(lin_heads, centres[perm]):
        la = dec.layers[i].linear_attn
        dt = DT_BIAS_RANGE[0] + (DT_BIAS_RANGE[1] - DT_BIAS_RANGE[0]) * torch.rand((), generator=gen).item()
        la.dt_bias[h] = dt
        la.A_log[h] = math.log(c.item() / F.softplus(torch.tensor(dt, dtype=torch.float64)).item())
    return {"decay_centres": [float(x) for x in centres]}


def linear_heads(config) -> list[tuple[int, int]]:
    """(layer, value head) of every DeltaNet value head, in layer order."""
    tc = text_config_of(config)
    return [
        (i, h)
        for i, kind in enumerate(tc.layer_types)
        if kind == "linear_attention"
        for h in range(tc.linear_num_value_heads)
    ]


@torch.no_grad()
def core_output_rms(model, config, ids: torch.Tensor) -> dict:
    """Per (layer, value head): the RMS of the recurrence's output (`core_output`, before the gated norm) over the
    prompt's tokens and Dv."""
    with Recorder(model, config) as rec:
        rec.active = True
        model(input_ids=ids, use_cache=False)
        rec.active = False
    return {
        (i, h): rec.t[f"layers.{i}.linear_attn.core_output"][:, h].double().pow(2).mean().sqrt().item()
        for i, h in linear_heads(config)
    }


@torch.no_grad()
def calibrate_core_output(model, config, ids: torch.Tensor, seed: int, rms_spec: dict) -> dict:
    """Scale the value rows of each DeltaNet layer's in_proj_qkv, per value head, so that the head's core_output RMS
    over the prompt lands on its target (SPEC "fp16 precision of the DeltaNet output": 1e-3..2e-2 in Qwen3.5-9B).
    Targets are log-spaced over rms_spec["targets"] and shuffled across (layer, head) pairs. The recurrence is linear
    in v, so the gain needed is target/measured, up to the SiLU after the conv: a few passes converge. Nothing random
    is drawn from the init generator, and no weight is zeroed; the gated norm after the recurrence is scale-invariant
    (up to its eps), so the rest of the model barely notices."""
    tc = text_config_of(config)
    dec = decoder_of(model)
    heads = linear_heads(config)
    lo, hi = (math.log(x) for x in rms_spec["targets"])
    levels = torch.exp(torch.linspace(lo, hi, len(heads), dtype=torch.float64))
    perm = torch.randperm(len(heads), generator=torch.Generator().manual_seed(seed))
    targets = {ih: levels[j].item() for ih, j in zip(heads, perm.tolist())}
    gains = {ih: 1.0 for ih in heads}
    v0, dv = 2 * tc.linear_num_key_heads * tc.linear_key_head_dim, tc.linear_value_head_dim
    for passes in range(1, CALIBRATION_PASSES + 1):
        rms = core_output_rms(model, config, ids)
        worst = max(abs(rms[ih] / targets[ih] - 1.0) for ih in heads)
        if worst <= CALIBRATION_TOL:
            break
        for i, h in heads:
            factor = targets[(i, h)] / rms[(i, h)]
            dec.layers[i].linear_attn.in_proj_qkv.weight[v0 + h * dv : v0 + (h + 1) * dv] *= factor
            gains[(i, h)] *= factor
    else:
        raise RuntimeError(f"core_output calibration did not converge: worst {worst:.3g}")
    return {
        "passes": passes,
        "targets": [{"layer": i, "head": h, "rms": targets[(i, h)]} for i, h in heads],
        # in_proj_qkv value rows of this head: N(0, gain * in_gain / sqrt(hidden_size))
        "value_row_gains": [{"layer": i, "head": h, "gain": gains[(i, h)]} for i, h in heads],
    }


def round_params_to_bf16(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def l2norm64(x: torch.Tensor) -> torch.Tensor:
    """The kernel's q/k l2 norm (fixed eps 1e-6), in float64."""
    x = x.double()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@torch.no_grad()
def layer_series(key: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, block: int) -> list[dict]:
    """Per value head of one DeltaNet layer, in float64 from the kernel inputs (`key` [T, Hk, Dk] before the l2 norm,
    `g`, `beta` [T, Hv]) of the first `block` tokens: the strictly lower N = diag(beta) [exp(G_t - G_j) k_t.k_j]_{j<t}
    of that block, its largest entry, the keys' cosines k_t.k_j (j < t), beta and exp(g) over the block, the largest
    entry of (I + N)^-1, and the largest entry of any intermediate of the series (I - N)(I + N^2)(I + N^4)... as the
    graphs evaluate it (every power N^(2^m) and every partial product): the factor by which the series amplifies
    rounding errors, while its result, (I + N)^-1, stays small."""
    hv = g.shape[1]
    k = l2norm64(key[:block]).repeat_interleave(hv // key.shape[1], dim=1)  # [T, Hv, Dk]
    g, beta = g[:block].double(), beta[:block].double()
    n_tok = k.shape[0]
    eye = torch.eye(n_tok, dtype=torch.float64)
    strict = torch.ones(n_tok, n_tok, dtype=torch.bool).tril(-1)
    rows = []
    for h in range(hv):
        kk = k[:, h] @ k[:, h].T
        big_g = torch.cumsum(g[:, h], 0)
        decay = torch.exp((big_g[:, None] - big_g[None, :]).masked_fill(~strict, 0.0)) * strict
        n = beta[:, h, None] * kk * decay
        prod, power, covered = eye - n, n, 2
        largest = prod.abs().max().item()
        while covered < n_tok:
            power = power @ power
            prod = prod @ (eye + power)
            largest = max(largest, power.abs().max().item(), prod.abs().max().item())
            covered *= 2
        inverse = torch.linalg.solve_triangular(eye + n, eye, upper=False, unitriangular=True)
        assert (prod - inverse).abs().max().item() <= 1e-10 * max(largest, 1.0), h  # exact in f64
        cos = kk[strict]
        rows.append({
            "head": h,
            "tokens": n_tok,
            "series_largest_intermediate": largest,
            "n_max": n.abs().max().item(),
            "inverse_offdiag_max_abs": (inverse * strict).abs().max().item(),
            "key_cosine_mean": cos.mean().item(),
            "key_cosine_min": cos.min().item(),
            "beta_min": beta[:, h].min().item(),
            "beta_max": beta[:, h].max().item(),
            "decay_exp_g_min": torch.exp(g[:, h]).min().item(),
        })
    return rows


def series_figures(config, t: dict, block: int) -> list[dict]:
    """`layer_series` for every DeltaNet layer of a run's tensors, one row per (layer, value head)."""
    tc = text_config_of(config)
    return [
        dict(layer=i, **row)
        for i, kind in enumerate(tc.layer_types)
        if kind == "linear_attention"
        for row in layer_series(*(t[f"layers.{i}.linear_attn.{n}"] for n in ("key", "g", "beta")), block)
    ]


@torch.no_grad()
def correlate_keys(model, config, ids: torch.Tensor, seed: int, cspec: dict) -> dict:
    """Make the chunked delta rule's N large on purpose, by construction of the weights (tiny-corr):

    - one residual-stream channel is a constant: every token's embedding holds `constant_value` there, and the rows
      of out_proj, o_proj and down_proj that would write to it are zero, so it reaches every layer unchanged (a
      stand-in for the massive, nearly constant activations of trained LLMs);
    - keys: the in_proj_qkv key rows read that channel with weight `key_shared_gain` times a fixed random direction
      u (per key head), on top of their usual N(0, 1/fan_in) weights: after the conv, SiLU and l2 norm every key is
      nearly the same vector, so k_t.k_j is close to 1;
    - decay: A_log set so that -g = exp(A_log) softplus(a + dt_bias) is centred on `decay_centre` (exp(g) about
      0.999): the decay ratios exp(G_t - G_j) stay near 1 across the block (and g stays an fp16 normal);
    - write strength: in_proj_b reads only that channel (b = gamma x_const), so beta = sigmoid(b) is nearly the same
      for every token; gamma is set per (layer, value head) so that the largest intermediate of the series over the
      first `growth_block` tokens is `growth_target` (a few forward passes, since each layer's beta changes the next
      layer's input). beta comes out near 0.2: with k.k ~ 1 and decay ~ 1, a beta near 1 makes the series' terms
      grow like binomial coefficients (about 2^63 at 64 tokens), beyond what even f32 can cancel.
    """
    tc = text_config_of(config)
    dec = decoder_of(model)
    ch, const = cspec["constant_channel"], cspec["constant_value"]
    hk, hv, dk = tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim
    gen = torch.Generator().manual_seed(seed + 500)  # its own stream: the usual init is unchanged
    dec.embed_tokens.weight[:, ch] = const
    for i, layer in enumerate(dec.layers):
        out = layer.linear_attn.out_proj if tc.layer_types[i] == "linear_attention" else layer.self_attn.o_proj
        out.weight[ch] = 0.0
        layer.mlp.down_proj.weight[ch] = 0.0
        assert 1.0 + layer.input_layernorm.weight[ch].item() > 0.1, "the constant channel's norm weight flips it"
    heads = linear_heads(config)
    for i in sorted({i for i, _ in heads}):
        la = dec.layers[i].linear_attn
        for j in range(hk):
            u = torch.randn(dk, generator=gen)
            rows = slice(hk * dk + j * dk, hk * dk + (j + 1) * dk)  # channels [Q | K | V]: key head j
            la.in_proj_qkv.weight[rows, ch] = cspec["key_shared_gain"] * u
        for h in range(hv):
            la.A_log[h] = math.log(cspec["decay_centre"] / F.softplus(la.dt_bias[h].double()).item())
        la.in_proj_b.weight.zero_()
        la.in_proj_b.weight[:, ch] = -0.5  # a start: beta = sigmoid(-0.5 x_const), calibrated below

    target = cspec["growth_target"]
    block = cspec["growth_block"]
    for passes in range(1, CALIBRATION_PASSES + 1):
        with Recorder(model, config) as rec:
            rec.active = True
            model(input_ids=ids, use_cache=False)
            rec.active = False
        figures = {(r["layer"], r["head"]): r for r in series_figures(config, rec.t, block)}
        worst = max(abs(math.log(figures[ih]["series_largest_intermediate"] / target)) for ih in heads)
        if worst <= math.log(1.0 + CALIBRATION_TOL):
            break
        for i, h in heads:
            # b = gamma x_const exactly, so scaling gamma by r scales every token's b by r: find r by bisection
            # on the recorded inputs (the growth falls as |b| grows, since b < 0)
            p = f"layers.{i}.linear_attn."
            b = torch.logit(rec.t[p + "beta"].double())
            assert (b < 0).all(), (i, h)

            def growth(r: float) -> float:
                rows = layer_series(rec.t[p + "key"], rec.t[p + "g"], torch.sigmoid(b * r), block)
                return rows[h]["series_largest_intermediate"]

            lo, hi = 1e-3, 1e3
            assert growth(lo) > target > growth(hi), (i, h, growth(lo), growth(hi))
            for _ in range(40):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if growth(mid) > target else (lo, mid)
            dec.layers[i].linear_attn.in_proj_b.weight[h, ch] *= math.sqrt(lo * hi)
    else:
        raise RuntimeError(f"series growth calibration did not converge: worst log gap {worst:.3g}")
    return {
        "passes": passes,
        "b_weights": [{"layer": i, "head": h, "gamma": dec.layers[i].linear_attn.in_proj_b.weight[h, ch].item()}
                      for i, h in heads],
        "key_directions_seed": seed + 500,
    }


# ------------------------------------------------------------------------------------------------------------------
# 7. Capturing goldens
# ------------------------------------------------------------------------------------------------------------------


class Recorder:
    """Forward hooks on the decoder plus a wrapper around the chunked gated-delta-rule kernel."""

    def __init__(self, model, config):
        self.model = model
        self.tc = text_config_of(config)
        self.dec = decoder_of(model)
        self.t = {}
        self.active = False
        self.current_linear_layer = None
        self.handles = []
        self.kernel_dtypes = set()

    def _save(self, name, x):
        if not self.active:
            return
        assert name not in self.t, f"{name} recorded twice"
        x = x.detach()
        assert x.shape[0] == 1, (name, x.shape)
        self.t[name] = x[0].clone().contiguous()

    def __enter__(self):
        dec = self.dec
        h = self.handles
        h.append(dec.embed_tokens.register_forward_hook(lambda m, a, o: self._save("embeddings", o)))
        h.append(dec.norm.register_forward_hook(lambda m, a, o: self._save("final_norm", o)))
        for i, layer in enumerate(dec.layers):
            h.append(layer.register_forward_hook(lambda m, a, o, i=i: self._save(f"layers.{i}.output", o)))
            h.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: self._save(f"layers.{i}.mlp_output", o)))
            if self.tc.layer_types[i] == "linear_attention":
                la = layer.linear_attn
                h.append(la.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "current_linear_layer", i)))
                h.append(la.register_forward_hook(lambda m, a, o, i=i: self._save(f"layers.{i}.mixer_output", o)))
            else:
                sa = layer.self_attn
                h.append(sa.register_forward_hook(lambda m, a, o, i=i: self._save(f"layers.{i}.mixer_output", o[0])))
                h.append(
                    sa.o_proj.register_forward_pre_hook(
                        lambda m, a, i=i: self._save(f"layers.{i}.self_attn.gated_output", a[0])
                    )
                )
        self.orig_chunk = modeling.torch_chunk_gated_delta_rule
        recorder = self

        def recording_chunk(query, key, value, *args, **kwargs):
            out = recorder.orig_chunk(query, key, value, *args, **kwargs)
            if recorder.active:
                i = recorder.current_linear_layer
                p = f"layers.{i}.linear_attn."
                recorder._save(p + "query", query)
                recorder._save(p + "key", key)
                recorder._save(p + "value", value)
                recorder._save(p + "g", kwargs["g"])
                recorder._save(p + "beta", kwargs["beta"])
                recorder._save(p + "core_output", out[0])
                recorder.kernel_dtypes.update(
                    str(x.dtype) for x in (query, key, value, kwargs["g"], kwargs["beta"], out[0])
                )
                recorder.kernel_calls.append(dict(args=(query, key, value), kwargs=kwargs, out=out))
            return out

        self.kernel_calls = []
        modeling.torch_chunk_gated_delta_rule = recording_chunk
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        modeling.torch_chunk_gated_delta_rule = self.orig_chunk
        return False


@contextlib.contextmanager
def true_float64():
    """model.double() alone is not an f64 run: Qwen3.5's modeling code casts to float32 inside the RMSNorms, the
    gated norm, both gated-delta-rule kernels, the rotary angles and the attention softmax. Inside this context
    the modeling module sees a `torch` whose float32/float mean float64, and Tensor.float() leaves f64 tensors as
    they are, so every one of those steps runs in f64. inv_freq keeps its f32-computed values (SPEC: computed in
    f32), upcast exactly."""

    class _TorchF64(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = _TorchF64("torch")
    proxy.float32 = torch.float64
    proxy.float = torch.float64
    orig_float = torch.Tensor.float

    def _float(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        return orig_float(self, *args, **kwargs)

    real = modeling.torch
    modeling.torch = proxy
    torch.Tensor.float = _float
    try:
        yield
    finally:
        modeling.torch = real
        torch.Tensor.float = orig_float


def greedy(model, ids: torch.Tensor, pad_id: int):
    """model.generate(do_sample=False) for exactly NUM_GENERATED tokens: eos is disabled (no eos id at all, so no
    min-length processor masks it either); asserts that no logits processor changed anything."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        num_beams=1,
        max_new_tokens=NUM_GENERATED,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )
    gen = out.sequences[0, ids.shape[1] :]
    assert gen.numel() == NUM_GENERATED, gen.shape
    step_logits = torch.stack([x[0] for x in out.logits])  # [16, V]
    step_scores = torch.stack([x[0] for x in out.scores])
    assert torch.equal(step_logits, step_scores), "a logits processor changed the greedy scores"
    assert torch.equal(step_logits.argmax(-1), gen), "generate() is not greedy"
    return gen.clone(), step_logits


def margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.double().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.no_grad()
def run_f32(model, config, ids: torch.Tensor, pad_id) -> dict:
    tc = text_config_of(config)
    with Recorder(model, config) as rec:
        rec.active = True
        out = model(input_ids=ids, use_cache=True)
        rec.active = False
        t = rec.t
        t["logits"] = out.logits[0].clone()
        cache = out.past_key_values
        for i, kind in enumerate(tc.layer_types):
            if kind == "linear_attention":
                t[f"layers.{i}.conv_state"] = cache.get_conv_state(i)[0].clone()
                t[f"layers.{i}.recurrent_state"] = cache.get_recurrent_state(i)[0].clone()
            else:
                t[f"layers.{i}.key_cache"] = cache.layers[i].keys[0].clone()
                t[f"layers.{i}.value_cache"] = cache.layers[i].values[0].clone()
        kernel_dtypes = set(rec.kernel_dtypes)
    gen, step_logits = greedy(model, ids, pad_id)
    t["token_ids"] = ids[0].clone()
    t["generated"] = gen
    return {"tensors": t, "step_logits": step_logits, "kernel_dtypes": kernel_dtypes}


@torch.no_grad()
def run_f64(model, config, ids: torch.Tensor, pad_id) -> dict:
    """model must already be .double(). Also cross-checks, in f64, the chunked kernel HF used against its
    token-by-token recurrent kernel on the same inputs."""
    with true_float64(), Recorder(model, config) as rec:
        rec.active = True
        out = model(input_ids=ids, use_cache=False)
        rec.active = False
        kernel_gap = 0.0
        for call in rec.kernel_calls:
            q, k, v = call["args"]
            kw = {key: call["kwargs"][key] for key in ("g", "beta", "use_qk_l2norm_in_kernel")}
            ref, _ = modeling.torch_recurrent_gated_delta_rule(q, k, v, initial_state=None, **kw)
            o = call["out"][0]
            assert o.dtype == torch.float64 and ref.dtype == torch.float64
            kernel_gap = max(kernel_gap, ((o - ref).abs().max() / ref.abs().max()).item())
        n_layers = len(text_config_of(config).layer_types)
        t = {f"layers.{i}.output": rec.t[f"layers.{i}.output"] for i in range(n_layers)}
        t["final_norm"] = rec.t["final_norm"]
        t["logits"] = out.logits[0].clone()
        # every captured activation (embeddings, mixer/MLP outputs, kernel inputs and outputs, ...) must be f64
        dtypes = set(rec.kernel_dtypes) | {str(x.dtype) for x in rec.t.values()} | {str(t["logits"].dtype)}
        gen, step_logits = greedy(model, ids, pad_id)
    assert dtypes == {"torch.float64"}, f"f64 run has non-f64 tensors: {dtypes}"
    # (generate() itself casts each step's logits to float32 before the argmax; the f64 model runs in f64)
    t["token_ids"] = ids[0].clone()
    t["generated"] = gen
    return {"tensors": t, "step_logits": step_logits, "chunk_vs_recurrent_rel": kernel_gap}


def diagnostics(config, res: dict) -> dict:
    tc = text_config_of(config)
    t = res["tensors"]
    gs = [t[f"layers.{i}.linear_attn.g"] for i, k in enumerate(tc.layer_types) if k == "linear_attention"]
    decay = torch.exp(torch.cat([g.reshape(-1) for g in gs]).double())
    per_layer = []
    prev = t["embeddings"]
    for i, kind in enumerate(tc.layer_types):
        mixer = t[f"layers.{i}.mixer_output"]
        mid = prev + mixer
        mlp = t[f"layers.{i}.mlp_output"]
        per_layer.append(
            {
                "layer": i,
                "kind": kind,
                "mixer_ratio": (mixer.norm() / prev.norm()).item(),
                "mlp_ratio": (mlp.norm() / mid.norm()).item(),
            }
        )
        prev = t[f"layers.{i}.output"]
    core_rms = [
        {
            "layer": i,
            "rms": t[f"layers.{i}.linear_attn.core_output"].double().pow(2).mean(dim=(0, 2)).sqrt().tolist(),
        }
        for i, k in enumerate(tc.layer_types)
        if k == "linear_attention"
    ]
    prompt_margin = margins(t["logits"]).min().item()
    greedy_margin = margins(res["step_logits"]).min().item()
    beta = torch.cat([t[f"layers.{i}.linear_attn.beta"].reshape(-1) for i, k in enumerate(tc.layer_types)
                      if k == "linear_attention"])
    g_all = torch.cat([g.reshape(-1) for g in gs])
    return {
        "decay_min": decay.min().item(),
        "decay_max": decay.max().item(),
        "g_min": g_all.min().item(),
        "g_max": g_all.max().item(),
        "beta_min": beta.min().item(),
        "beta_max": beta.max().item(),
        "per_layer": per_layer,
        "core_output_rms": core_rms,
        "min_margin_prompt": prompt_margin,
        "min_margin_greedy": greedy_margin,
        "logit_std": t["logits"].std().item(),
        "distinct_generated": len(set(t["generated"].tolist())),
        "series": series_figures(config, t, SERIES_BLOCK),
    }


@torch.no_grad()
def fp16_product_shares(config, t: dict) -> list[dict]:
    """The products S_ij * q_i of o = S^T q (per token, after that token's state update), from the golden's kernel
    inputs, in float64: per (layer, value head) the share whose magnitude is below fp16's smallest normal (flushed to
    zero where subnormals are) and below its smallest subnormal. q and k are l2-normalised and q scaled by Dk^-0.5 as
    in the kernel."""
    tc = text_config_of(config)
    hk, hv, dk = tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim

    def l2norm(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    rows = []
    for i, kind in enumerate(tc.layer_types):
        if kind != "linear_attention":
            continue
        p = f"layers.{i}.linear_attn."
        q = (l2norm(t[p + "query"].double()) * dk**-0.5).repeat_interleave(hv // hk, dim=1)  # [T, Hv, Dk]
        k = l2norm(t[p + "key"].double()).repeat_interleave(hv // hk, dim=1)
        v, g, beta = (t[p + n].double() for n in ("value", "g", "beta"))
        state = torch.zeros(hv, dk, v.shape[-1], dtype=torch.float64)
        below_normal = torch.zeros(hv, dtype=torch.float64)
        below_subnormal = torch.zeros(hv, dtype=torch.float64)
        for step in range(q.shape[0]):
            state = state * g[step].exp()[:, None, None]
            delta = beta[step][:, None] * (v[step] - torch.einsum("hkv,hk->hv", state, k[step]))
            state = state + k[step][:, :, None] * delta[:, None, :]
            prod = (state * q[step][:, :, None]).abs()
            below_normal += (prod < FP16_MIN_NORMAL).double().sum(dim=(1, 2))
            below_subnormal += (prod < FP16_MIN_SUBNORMAL).double().sum(dim=(1, 2))
        total = q.shape[0] * dk * v.shape[-1]
        rows.append({"layer": i, "below_min_normal": (below_normal / total).tolist(),
                     "below_min_subnormal": (below_subnormal / total).tolist()})
    return rows


def acceptable(diag: dict, spec: dict) -> list[str]:
    bad = []
    cspec = spec.get("correlated_keys")
    if cspec is not None:
        assert cspec["growth_block"] == SERIES_BLOCK
        lo, hi = cspec["growth_accept"]
        for row in diag["series"]:
            if not lo <= row["series_largest_intermediate"] <= hi:
                bad.append(f"layer {row['layer']} head {row['head']} series growth "
                           f"{row['series_largest_intermediate']:.3g} outside {lo:g}..{hi:g}")
    sspec = spec.get("strong_decay")
    if sspec is not None:
        lo, hi = sspec["g_min_accept"]
        if not lo <= diag["g_min"] <= hi:
            bad.append(f"strongest decay g {diag['g_min']:.3g} outside {lo:g}..{hi:g}")
        if diag["g_max"] < sspec["g_max_at_least"]:
            bad.append(f"weakest decay g {diag['g_max']:.3g} below {sspec['g_max_at_least']:g}")
    rms_spec = spec.get("core_output_rms")
    if rms_spec is not None:
        rms = [x for row in diag["core_output_rms"] for x in row["rms"]]
        lo, hi = rms_spec["accept"]
        if not all(lo <= x <= hi for x in rms):
            bad.append(f"core_output RMS {min(rms):.3g}..{max(rms):.3g} outside {lo:g}..{hi:g}")
        if min(rms) > rms_spec["smallest_at_most"] or max(rms) < rms_spec["largest_at_least"]:
            bad.append(f"core_output RMS {min(rms):.3g}..{max(rms):.3g} not spread")
    if diag["min_margin_prompt"] <= MIN_MARGIN:
        bad.append(f"prompt margin {diag['min_margin_prompt']:.3g}")
    if diag["min_margin_greedy"] <= MIN_MARGIN:
        bad.append(f"greedy margin {diag['min_margin_greedy']:.3g}")
    if diag["distinct_generated"] < MIN_DISTINCT_GENERATED:
        bad.append(f"only {diag['distinct_generated']} distinct generated tokens")
    for row in diag["per_layer"]:
        for key in ("mixer_ratio", "mlp_ratio"):
            if not RATIO_RANGE[0] <= row[key] <= RATIO_RANGE[1]:
                bad.append(f"layer {row['layer']} {key} {row[key]:.3g}")
    return bad


def print_diag(name: str, diag: dict) -> None:
    log(f"[{name}] g over the prompt: {diag['g_min']:.4g}..{diag['g_max']:.4g}")
    log(f"[{name}] exp(g) over the prompt: min {diag['decay_min']:.6g}  max {diag['decay_max']:.8g}"
        f"   beta: {diag['beta_min']:.3f}..{diag['beta_max']:.3f}")
    for row in diag["per_layer"]:
        log(f"[{name}]   layer {row['layer']} {row['kind']:<16} ||mixer||/||resid in|| = {row['mixer_ratio']:.3f}"
            f"   ||mlp||/||resid in|| = {row['mlp_ratio']:.3f}")
    for row in diag["core_output_rms"]:
        log(f"[{name}]   layer {row['layer']} core_output RMS per value head: "
            + " ".join(f"{x:.3e}" for x in row["rms"]))
    for row in diag["series"]:
        log(f"[{name}]   layer {row['layer']} head {row['head']} first {row['tokens']} tokens: largest series "
            f"intermediate {row['series_largest_intermediate']:.3g}, max N {row['n_max']:.3f}, key cosine mean "
            f"{row['key_cosine_mean']:.3f} min {row['key_cosine_min']:.3f}, beta {row['beta_min']:.3f}.."
            f"{row['beta_max']:.3f}, exp(g) min {row['decay_exp_g_min']:.6f}")
    log(f"[{name}] min top1-top2 margin: prompt {diag['min_margin_prompt']:.4f}  greedy "
        f"{diag['min_margin_greedy']:.4f}   logits std {diag['logit_std']:.2f}")


# ------------------------------------------------------------------------------------------------------------------
# 8. Checkpoint writing
# ------------------------------------------------------------------------------------------------------------------


def copy_tokenizer(dst: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TESTDATA / f, dst / f)


def save_text_checkpoint(name: str, spec: dict, model, out_dir: Path) -> None:
    if weights_dtype_of(spec) == "bfloat16":
        model = model.to(torch.bfloat16)  # exact: the parameters were rounded to bf16 before the goldens
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="1GB")
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "drop_layer_types_for_interval" in spec:
        interval = spec["drop_layer_types_for_interval"]
        derived = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(cfg["num_hidden_layers"])
        ]
        assert cfg["layer_types"] == derived, (cfg["layer_types"], derived)
        del cfg["layer_types"]
        cfg["full_attention_interval"] = interval
    write_json(cfg_path, cfg)
    names = sorted(load_file(out_dir / "model.safetensors").keys())
    assert all(n.startswith("model.") or n == "lm_head.weight" for n in names), names
    assert ("lm_head.weight" in names) == (not spec["text"]["tie_word_embeddings"]), name
    want = torch.bfloat16 if weights_dtype_of(spec) == "bfloat16" else torch.float32
    assert all(v.dtype == want for v in load_file(out_dir / "model.safetensors").values()), name
    copy_tokenizer(out_dir)


def fabricated_mtp_tensors(tc, seed: int) -> dict:
    """A few tensors under mtp.* shaped like the real checkpoint's multi-token-prediction head (not part of the
    decoder; loaders must skip them)."""
    gen = torch.Generator().manual_seed(seed)
    H, I, D = tc.hidden_size, tc.intermediate_size, tc.head_dim
    nh, nkv = tc.num_attention_heads, tc.num_key_value_heads
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * D, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * D, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * D, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nh * D),
        "mtp.layers.0.self_attn.q_norm.weight": (D,),
        "mtp.layers.0.self_attn.k_norm.weight": (D,),
        "mtp.layers.0.mlp.gate_proj.weight": (I, H),
        "mtp.layers.0.mlp.up_proj.weight": (I, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, I),
        "mtp.norm.weight": (H,),
    }
    return {
        k: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for k, s in sorted(shapes.items())
    }


def save_full_checkpoint(name: str, spec: dict, model, config, out_dir: Path, seed: int) -> None:
    """Real layout: nested config, bf16, two shards + index, model.language_model.* / model.visual.* / lm_head /
    mtp.*."""
    model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="1GB")
        tmp = Path(tmp)
        files = sorted(tmp.glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(load_file(f))
        for extra in ("config.json", "generation_config.json"):
            if (tmp / extra).exists():
                shutil.copyfile(tmp / extra, out_dir / extra)
    for k, v in state.items():
        assert v.dtype == torch.bfloat16, (k, v.dtype)
        assert k.startswith(("model.language_model.", "model.visual.")) or k == "lm_head.weight", k
    state.update(fabricated_mtp_tensors(text_config_of(config), seed + 777))
    names = sorted(state)
    # shard 1: the decoder's embedding and first half of the layers; shard 2: the rest (like a real split, a layer
    # never straddles two files here, but loaders must not assume any order).
    n_layers = text_config_of(config).num_hidden_layers

    def shard_of(k: str) -> int:
        if k.startswith("model.language_model.layers."):
            return 1 if int(k.split(".")[3]) < n_layers // 2 else 2
        if k.startswith("model.language_model.embed_tokens"):
            return 1
        return 2

    shard_names = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    weight_map = {}
    total = 0
    for s in (1, 2):
        part = {k: state[k].contiguous() for k in names if shard_of(k) == s}
        save_file(part, out_dir / shard_names[s], metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = shard_names[s]
            total += v.numel() * v.element_size()
    write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["text_config"]["model_type"] == "qwen3_5_text", cfg
    assert "vision_config" in cfg
    copy_tokenizer(out_dir)


def load_checkpoint(spec: dict, path: Path):
    cls = AutoModelForCausalLM if spec["format"] == "text" else AutoModelForImageTextToText
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def save_golden(path: Path, tensors: dict, metadata: dict, want_dtype: torch.dtype) -> None:
    out = {}
    for k in sorted(tensors):
        v = tensors[k]
        if k in ("token_ids", "generated"):
            assert v.dtype == torch.int64, (k, v.dtype)
        else:
            assert v.dtype == want_dtype, (k, v.dtype)
        out[k] = v.contiguous()
    save_file(out, path, metadata=metadata)


# ------------------------------------------------------------------------------------------------------------------
# 9. Per-model pipeline
# ------------------------------------------------------------------------------------------------------------------


def make_model(name: str, spec: dict, tok_info: dict, hf_tok) -> dict:
    vocab = tok_info["vocab_size"]
    special = tok_info["added_tokens"]
    prompt_text, ids_list = render_prompt(hf_tok, name)
    T = len(ids_list)
    assert PROMPT_LEN_RANGE[0] <= T <= PROMPT_LEN_RANGE[1], f"{name}: prompt has {T} tokens"
    ids = torch.tensor([ids_list], dtype=torch.long)
    pad_id = special["<|endoftext|>"]

    # --- seed search
    for attempt in range(MAX_ATTEMPTS):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        config = make_config(spec, vocab, special)
        config._attn_implementation = "eager"
        text_config_of(config)._attn_implementation = "eager"
        model = new_model(spec, config)
        init_info = reinit(model, config, seed, spec.get("init"),
                           spec.get("decay_centre_range", DECAY_CENTRE_RANGE))
        if "core_output_rms" in spec:
            init_info.update(calibrate_core_output(model, config, ids, seed, spec["core_output_rms"]))
        if "correlated_keys" in spec:
            init_info.update(correlate_keys(model, config, ids, seed, spec["correlated_keys"]))
        if weights_dtype_of(spec) == "bfloat16":
            round_params_to_bf16(model)  # evaluate exactly what the bf16 checkpoint will hold
        res = run_f32(model, config, ids, pad_id)
        diag = diagnostics(config, res)
        bad = acceptable(diag, spec)
        if not bad:
            break
        log(f"[{name}] seed {seed} rejected: {', '.join(bad)}")
    else:
        raise RuntimeError(f"{name}: no acceptable seed in {MAX_ATTEMPTS} attempts")
    log(f"[{name}] seed {seed} accepted (attempt {attempt + 1})")
    search_logits = res["tensors"]["logits"]

    # --- write the checkpoint, load it back the ordinary way, compute the goldens from the loaded model
    out_dir = TESTDATA / "models" / name
    out_dir.mkdir(parents=True)
    # as in Qwen3.5's generation_config.json: stop on <|im_end|> or <|endoftext|> (the goldens disable eos)
    model.generation_config = GenerationConfig(
        eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]], pad_token_id=pad_id, do_sample=False
    )
    if spec["format"] == "text":
        save_text_checkpoint(name, spec, model, out_dir)
    else:
        save_full_checkpoint(name, spec, model, config, out_dir, seed)
    del model

    loaded = load_checkpoint(spec, out_dir)
    lconf = loaded.config
    ltc = text_config_of(lconf)
    assert list(ltc.layer_types) == spec["text"]["layer_types"], (name, ltc.layer_types)
    assert ltc.vocab_size == vocab
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    if weights_dtype_of(spec) == "bfloat16":
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in loaded.parameters()), name
    assert lconf._attn_implementation == "eager" and ltc._attn_implementation == "eager"
    res = run_f32(loaded, lconf, ids, pad_id)
    assert torch.equal(res["tensors"]["logits"], search_logits), f"{name}: checkpoint does not round-trip"
    diag = diagnostics(lconf, res)
    assert not acceptable(diag, spec), acceptable(diag, spec)
    print_diag(name, diag)
    t32 = res["tensors"]
    assert t32["token_ids"].tolist() == ids_list
    assert res["kernel_dtypes"] == {"torch.float32"}, res["kernel_dtypes"]

    loaded64 = load_checkpoint(spec, out_dir).double()
    res64 = run_f64(loaded64, lconf, ids, pad_id)
    t64 = res64["tensors"]
    logit_diff = (t32["logits"].double() - t64["logits"]).abs().max().item()
    hidden_diff = max(
        (t32[k].double() - t64[k]).abs().max().item() for k in t64 if k.startswith("layers.")
    )
    same_greedy = torch.equal(t32["generated"], t64["generated"])
    assert same_greedy, f"{name}: f32 and f64 greedy continuations differ"
    log(f"[{name}] f32 vs f64: logits max |diff| {logit_diff:.3e}   layer outputs max |diff| {hidden_diff:.3e}"
        f"   f64 chunk-vs-recurrent kernel rel gap {res64['chunk_vs_recurrent_rel']:.2e}")
    log(f"[{name}] generated: {t32['generated'].tolist()}")
    assert res64["chunk_vs_recurrent_rel"] < 1e-10, res64["chunk_vs_recurrent_rel"]

    # --- shapes
    T, Hd = t32["embeddings"].shape
    assert Hd == ltc.hidden_size and t32["logits"].shape == (T, vocab)
    for i, kind in enumerate(ltc.layer_types):
        if kind == "linear_attention":
            Hk, Hv = ltc.linear_num_key_heads, ltc.linear_num_value_heads
            Dk, Dv, K = ltc.linear_key_head_dim, ltc.linear_value_head_dim, ltc.linear_conv_kernel_dim
            p = f"layers.{i}."
            assert t32[p + "linear_attn.query"].shape == (T, Hk, Dk)
            assert t32[p + "linear_attn.key"].shape == (T, Hk, Dk)
            assert t32[p + "linear_attn.value"].shape == (T, Hv, Dv)
            assert t32[p + "linear_attn.g"].shape == (T, Hv)
            assert t32[p + "linear_attn.beta"].shape == (T, Hv)
            assert t32[p + "linear_attn.core_output"].shape == (T, Hv, Dv)
            assert t32[p + "conv_state"].shape == (2 * Hk * Dk + Hv * Dv, K)
            assert t32[p + "recurrent_state"].shape == (Hv, Dk, Dv)
        else:
            D, Hkv, Hq = ltc.head_dim, ltc.num_key_value_heads, ltc.num_attention_heads
            assert t32[f"layers.{i}.key_cache"].shape == (Hkv, T, D)
            assert t32[f"layers.{i}.value_cache"].shape == (Hkv, T, D)
            assert t32[f"layers.{i}.self_attn.gated_output"].shape == (T, Hq * D)

    # --- goldens
    p = PROMPTS[name]
    kwargs = p["chat_template_kwargs"]
    meta = {
        "model": name,
        "model_dir": f"testdata/models/{name}",
        "prompt_text": prompt_text,
        "messages": json.dumps(p["messages"], ensure_ascii=False),
        "enable_thinking": "false" if kwargs.get("enable_thinking") is False else "true",
        "chat_template_kwargs": json.dumps(kwargs),
        "add_generation_prompt": "true",
        "prompt_len": str(T),
        "num_generated": str(NUM_GENERATED),
        "layer_types": json.dumps(list(ltc.layer_types)),
        "producer": f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, "
                    "no fla (torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule)",
        "batch_dim": "removed",
    }
    gdir = TESTDATA / "goldens"
    bf16 = weights_dtype_of(spec) == "bfloat16"
    save_golden(gdir / f"{name}.safetensors", t32, dict(meta, dtype="float32", weights_dtype=(
        "bfloat16 checkpoint upcast to float32" if bf16 else "float32")), torch.float32)
    save_golden(gdir / f"{name}.f64.safetensors", t64, dict(meta, dtype="float64", weights_dtype=(
        ("bfloat16 checkpoint upcast to float32" if bf16 else "float32 checkpoint")
        + ", then model.double(); every float32 cast inside the modeling code redirected to float64")),
        torch.float64)

    shares = fp16_product_shares(ltc, t32)
    for row in shares:
        log(f"[{name}]   layer {row['layer']} share of |S_ij q_i| below fp16's smallest normal per value head: "
            + " ".join(f"{x:.3f}" for x in row["below_min_normal"]))
    entry = {
        "format": spec["format"],
        "class": type(loaded).__name__,
        "seed": seed,
        "attempts": attempt + 1,
        "init_overrides": spec.get("init", {}),
        "weights_dtype": weights_dtype_of(spec),
        "config": {
            k: (list(v) if isinstance(v, (list, tuple)) else v)
            for k, v in dict(spec["text"], vocab_size=vocab).items()
        },
        "config_json_has_layer_types": "drop_layer_types_for_interval" not in spec,
        "full_attention_interval": spec.get("drop_layer_types_for_interval"),
        "vision_config": spec.get("vision"),
        "prompt_len": T,
        "enable_thinking": meta["enable_thinking"] == "true",
        "chat_template_kwargs": kwargs,
        "decay_exp_g_min": diag["decay_min"],
        "decay_exp_g_max": diag["decay_max"],
        "decay_g_range": [diag["g_min"], diag["g_max"]],
        "beta_range": [diag["beta_min"], diag["beta_max"]],
        "min_margin_prompt": diag["min_margin_prompt"],
        "min_margin_greedy": diag["min_margin_greedy"],
        "residual_ratios": diag["per_layer"],
        "f32_vs_f64_logits_max_abs_diff": logit_diff,
        "f32_vs_f64_layer_outputs_max_abs_diff": hidden_diff,
        "f64_chunk_vs_recurrent_rel_gap": res64["chunk_vs_recurrent_rel"],
        "generated": t32["generated"].tolist(),
        "decay_centres": init_info["decay_centres"],
        # per value head over the prompt (tokens and Dv): the RMS of core_output, and the share of the products
        # S_ij * q_i of o = S^T q below fp16's smallest normal 2^-14 and smallest subnormal 2^-24
        "core_output_rms": diag["core_output_rms"],
        "fp16_product_shares": shares,
    }
    if "core_output_rms" in spec:
        entry["core_output_calibration"] = dict(
            spec["core_output_rms"],
            acceptance="the other models' seed checks apply unchanged (margins, residual ratios, distinct greedy "
                       "tokens); this RMS check comes on top",
            passes=init_info["passes"],
            targets=init_info["targets"],
            value_row_gains=init_info["value_row_gains"],
        )
    if "strong_decay" in spec:
        entry["strong_decay"] = dict(
            spec["strong_decay"],
            decay_centre_range=list(spec["decay_centre_range"]),
            acceptance="the other models' seed checks apply unchanged (margins, residual ratios, distinct greedy "
                       "tokens); the range of g comes on top",
        )
    if "correlated_keys" in spec:
        # per (layer, value head), over the first SERIES_BLOCK prompt tokens: N of the chunked form and how far the
        # series (I - N)(I + N^2)... for its inverse grows before it cancels (layer_series)
        entry["series"] = diag["series"]
        entry["correlated_keys"] = dict(
            spec["correlated_keys"],
            acceptance="the other models' seed checks apply unchanged (margins, residual ratios, distinct greedy "
                       "tokens); the series growth check comes on top",
            passes=init_info["passes"],
            b_weights=init_info["b_weights"],
            key_directions_seed=init_info["key_directions_seed"],
        )
    return entry


# ------------------------------------------------------------------------------------------------------------------
# 10. fla golden (child process) and a cross-check of HF's torch kernels against it
# ------------------------------------------------------------------------------------------------------------------


def run_fla_check() -> dict:
    out = TESTDATA / "goldens" / "fla.safetensors"
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fla_check.py"), "--out", str(out), "--seed", str(FLA_SEED)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    sys.stdout.write(proc.stdout)
    report = json.loads(proc.stdout.strip().splitlines()[-1].split("FLA_REPORT ", 1)[1])

    # HF's own torch kernels on the same inputs (this process has no fla). They hardcode scale = K^-0.5 and the
    # inputs are already l2-normalised, so use_qk_l2norm_in_kernel=False.
    t = load_file(out)
    with safetensors.safe_open(out, "pt") as f:
        meta = f.metadata()
    scale = float(meta["scale"])
    assert abs(scale - t["q"].shape[-1] ** -0.5) < 1e-12
    args = (t["q"], t["k"], t["v"])
    kw = dict(g=t["g"], beta=t["beta"], initial_state=t["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=False)
    hf_rec = modeling.torch_recurrent_gated_delta_rule(*args, **kw)
    hf_chunk = modeling.torch_chunk_gated_delta_rule(*args, chunk_size=int(meta["chunk_size"]), **kw)
    gaps = {
        "hf_recurrent_vs_fla_recurrent_o": (hf_rec[0] - t["recurrent.o"]).abs().max().item(),
        "hf_recurrent_vs_fla_recurrent_state": (hf_rec[1] - t["recurrent.state"]).abs().max().item(),
        "hf_chunk_vs_fla_chunk_o": (hf_chunk[0] - t["chunk.o"]).abs().max().item(),
        "hf_chunk_vs_fla_chunk_state": (hf_chunk[1] - t["chunk.state"]).abs().max().item(),
    }
    for k, v in gaps.items():
        log(f"[fla] {k}: {v:.3e}")
        assert v < 1e-3, (k, v)
    report["hf_torch_kernels_vs_fla"] = gaps
    return report


# ------------------------------------------------------------------------------------------------------------------
# 11. main
# ------------------------------------------------------------------------------------------------------------------


def main() -> None:
    set_determinism()
    transformers.utils.logging.disable_progress_bar()
    kernel_report = assert_torch_kernels_and_count_calls()
    log(f"transformers {transformers.__version__}  torch {torch.__version__}  tokenizers {tokenizers.__version__}")
    log("kernels dispatched to: " + ", ".join(kernel_report.values()))

    TESTDATA.mkdir(exist_ok=True)
    for sub in ("models", "goldens"):
        shutil.rmtree(TESTDATA / sub, ignore_errors=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "manifest.json"):
        (TESTDATA / f).unlink(missing_ok=True)
    (TESTDATA / "models").mkdir()
    (TESTDATA / "goldens").mkdir()

    tok_info = build_tokenizer(TESTDATA)
    tok_info.update(check_tokenizer(TESTDATA))
    log(f"tokenizer: vocab {tok_info['vocab_size']} ({tok_info['bpe_vocab_size']} BPE + "
        f"{len(tok_info['added_tokens'])} added), trained on {tok_info['corpus_bytes']} bytes")
    hf_tok = AutoTokenizer.from_pretrained(TESTDATA)

    models = {}
    for name, spec in MODEL_SPECS.items():
        models[name] = make_model(name, spec, tok_info, hf_tok)

    fla_report = run_fla_check()

    assert all(n > 0 for n in KERNEL_CALLS.values()), KERNEL_CALLS
    for name in BLOCKED_MODULES:
        assert name not in sys.modules, f"{name} got imported"

    for path in sorted(TESTDATA.rglob("*.safetensors")):
        before = {k: v.clone() for k, v in load_file(path).items()}
        with safetensors.safe_open(path, "pt") as f:
            meta_before = f.metadata()
        canonicalize_safetensors_header(path)
        after = load_file(path)
        with safetensors.safe_open(path, "pt") as f:
            assert f.metadata() == meta_before, path
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), path

    files = []
    for path in sorted(TESTDATA.rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            files.append({"path": rel(path), "bytes": path.stat().st_size, "sha256": sha256(path)})
    for name, m in models.items():
        m["files"] = [f for f in files if f["path"].startswith((f"testdata/models/{name}/",
                                                                 f"testdata/goldens/{name}."))]
    manifest = {
        "generator": "scripts/make_testdata.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            # PyPI's torch 2.15.0 for Linux x86_64 is a CUDA build ("+cu132"); the goldens are computed on the CPU.
            "torch_cuda": torch.version.cuda,
            "torch_device": "cpu",
            "platform": f"{platform.system()} {platform.machine()}",
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": dist_version("safetensors"),
            "numpy": np.__version__,
            "fla-core": fla_report["fla_version"],
        },
        "seeds": {
            "models": {name: m["seed"] for name, m in models.items()},
            "model_seed_bases": {name: s["seed"] for name, s in MODEL_SPECS.items()},
            "fla": FLA_SEED,
            "tokenizer": "none (BPE training is deterministic)",
        },
        "settings": {
            "torch_threads": 1,
            "attn_implementation": "eager",
            "gated_delta_rule_kernels": kernel_report,
            "kernel_calls": dict(KERNEL_CALLS),
            "blocked_modules_in_hf_process": list(BLOCKED_MODULES),
            "init": INIT,
            "decay_centre_range": list(DECAY_CENTRE_RANGE),
            "dt_bias_range": list(DT_BIAS_RANGE),
            "min_margin": MIN_MARGIN,
            "ratio_range": list(RATIO_RANGE),
            "min_distinct_generated": MIN_DISTINCT_GENERATED,
            "core_output_calibration": {"max_passes": CALIBRATION_PASSES, "relative_tolerance": CALIBRATION_TOL},
            "fp16_thresholds": {"min_normal": FP16_MIN_NORMAL, "min_subnormal": FP16_MIN_SUBNORMAL},
            "num_generated": NUM_GENERATED,
        },
        "tokenizer": tok_info,
        "chat_template": CHAT_TEMPLATE,
        "models": models,
        "fla": fla_report,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files),
    }
    write_json(TESTDATA / "manifest.json", manifest)
    ours = [p for p in TESTDATA.rglob("*") if p.is_file() and p.relative_to(TESTDATA).parts[0] in
            ("models", "goldens", "tokenizer.json", "tokenizer_config.json")]
    total = sum(p.stat().st_size for p in ours)
    assert total < MAX_TESTDATA_BYTES, f"this script wrote {total} bytes to testdata/"
    log(f"kernel calls: {KERNEL_CALLS}")
    log(f"wrote {len(files) + 1} files, {manifest['total_bytes'] / 1e6:.2f} MB (+ manifest)")


if __name__ == "__main__":
    main()
