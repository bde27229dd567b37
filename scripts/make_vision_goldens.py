#!/usr/bin/env python3
"""A tiny multimodal model (`tiny-vl`) and its goldens from transformers' Qwen3_5ForConditionalGeneration.

Writes, from nothing but the testdata tokenizer (run scripts/make_testdata.py first):

- `testdata/models/tiny-vl/`: the real checkpoint layout (nested config, bf16, two shards and an index,
  `model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`), a 4-layer decoder and a 2-block vision
  tower whose learned position table (6x6) is resampled to grids of other sizes; the testdata tokenizer with the four
  vision tokens added (`<|vision_start|>` 512, `<|vision_end|>` 513, `<|image_pad|>` 514, `<|video_pad|>` 515); a
  `preprocessor_config.json` for transformers' Qwen2VL image processor (patch 4, merge 2).
- `testdata/images/{wide,small}.png`: two drawn images of sizes the processor must resize (37x29 and 20x13).
- `testdata/goldens/tiny-vl.safetensors` (f32) and `tiny-vl.f64.safetensors` (the same runs in f64, as
  make_testdata.py's true_float64 makes them; the interpolation weights of the position table stay f32, as
  transformers computes them outside the modeling module).

Cases (tensor names `{case}.{name}`):
- `images`: a prompt with both images. `pixel_values` [N, 3*2*4*4] and `image_grid_thw` [2, 3] from the processor
  (PIL backend, bicubic); the vision taps `vision.patch_embed` (the Conv3d's output), `vision.pos_embed` (the
  resampled table), `vision.blocks.{i}.output`, `vision.merger`; `token_ids`, `mm_token_type_ids`, `positions`
  [3, T] from get_rope_index; the decoder's input `embeddings` (the merger's rows in place of the image tokens'),
  `layers.{i}.output`,
  `final_norm`, `logits` [T, V]; `generated` (8 greedy tokens, eos disabled) and their `step_logits`.
- `video`: two frames of random patches (`pixel_values_videos`, `video_grid_thw` [[2, 4, 6]]), the frames separated
  by timestamp text as Qwen3.5's template writes them: the same vision taps, the positions and the decoder's outputs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_testdata as mt  # noqa: E402  (hides fla before transformers is imported)
from testdata_files import add_golden, write_json  # noqa: E402

import math  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402
import PIL  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import AddedToken, Tokenizer  # noqa: E402
from transformers import Qwen3_5Config  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.vision_utils import get_vision_interpolation_indices_and_weights  # noqa: E402

NAME = "tiny-vl"
SEED = 5000
VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content | trim -}}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
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
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
NUM_GENERATED = 8
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    # rotary dim 8: sections of 2, 1, 1 frequency pairs for t, h, w, interleaved
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1], mrope_interleaved=True),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=36,
    hidden_act="gelu_pytorch_tanh",
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 64, "longest_edge": 4096},
}
# Vision re-initialisation: transformers' default (N(0, 0.02)) makes the merger's rows ~100x smaller than the text
# embeddings, so the image would barely move the text. "/fan" = divided by sqrt(fan_in).
VISION_INIT = dict(linear_gain=1.0, bias_std=0.1, norm_weight_std=0.1, norm_bias_std=0.1, pos_std=0.5,
                   merger_out_gain=1.0)


def draw_images(out_dir: Path) -> dict[str, Path]:
    """Two RGB images with edges, gradients and noise (so the bicubic resize has something to get wrong)."""
    rng = np.random.default_rng(SEED)
    out = {}
    for name, (w, h) in (("wide", (37, 29)), ("small", (20, 13))):
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        r = 255 * (x / (w - 1))
        g = 255 * (0.5 + 0.5 * np.sin(y / 3.0 + x / 5.0))
        b = np.where((x - w / 2) ** 2 + (y - h / 2) ** 2 < (min(w, h) / 3) ** 2, 230.0, 25.0)
        img = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (h, w, 3))
        img = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        path = out_dir / f"{name}.png"
        Image.fromarray(img, "RGB").save(path, optimize=False, compress_level=9)
        out[name] = path
    return out


def build_tokenizer(model_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(mt.TESTDATA / "tokenizer.json"))
    first = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    for i, t in enumerate(VISION_TOKENS):
        assert tok.token_to_id(t) == first + i, (t, tok.token_to_id(t))
    tok.save(str(model_dir / "tokenizer.json"))
    cfg = json.loads((mt.TESTDATA / "tokenizer_config.json").read_text(encoding="utf-8"))
    for t in VISION_TOKENS:
        cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
    # The chat template takes a message's content as a list of parts, as Qwen3.5's does: an image part writes
    # the placeholder the processor expands to the image's merged rows.
    cfg["chat_template"] = VL_CHAT_TEMPLATE
    write_json(model_dir / "tokenizer_config.json", cfg)
    return tok


@torch.no_grad()
def reinit_vision(visual, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    def linear_(lin, gain: float) -> None:
        fan = lin.weight[0].numel()
        normal_(lin.weight, gain / math.sqrt(fan))
        normal_(lin.bias, VISION_INIT["bias_std"])

    def norm_(ln) -> None:
        normal_(ln.weight, VISION_INIT["norm_weight_std"], mean=1.0)
        normal_(ln.bias, VISION_INIT["norm_bias_std"])

    linear_(visual.patch_embed.proj, VISION_INIT["linear_gain"])
    normal_(visual.pos_embed.weight, VISION_INIT["pos_std"])
    for blk in visual.blocks:
        norm_(blk.norm1)
        norm_(blk.norm2)
        for lin in (blk.attn.qkv, blk.attn.proj, blk.mlp.linear_fc1, blk.mlp.linear_fc2):
            linear_(lin, VISION_INIT["linear_gain"])
    norm_(visual.merger.norm)
    linear_(visual.merger.linear_fc1, VISION_INIT["linear_gain"])
    linear_(visual.merger.linear_fc2, VISION_INIT["merger_out_gain"])


class VisionRecorder:
    def __init__(self, visual):
        self.visual = visual
        self.t = {}
        self.handles = []

    def _save(self, name, x):
        assert name not in self.t, f"{name} recorded twice"
        self.t[name] = x.detach().clone().contiguous()

    def __enter__(self):
        v = self.visual
        self.handles.append(v.patch_embed.register_forward_hook(lambda m, a, o: self._save("vision.patch_embed", o)))
        for i, blk in enumerate(v.blocks):
            self.handles.append(blk.register_forward_hook(lambda m, a, o, i=i: self._save(f"vision.blocks.{i}.output", o)))
        self.handles.append(v.merger.register_forward_hook(lambda m, a, o: self._save("vision.merger", o)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def pos_embed(visual, grid_thw: torch.Tensor) -> torch.Tensor:
    """The resampled position table exactly as Qwen3_5VisionModel.forward computes it."""
    idx, w = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
    return (visual.pos_embed(idx) * w[:, :, None]).sum(1)


def prompt_images(tok: Tokenizer, grids: torch.Tensor) -> list[int]:
    pads = [int(g.prod()) // 4 for g in grids]
    text = ("<|im_start|>user\nThe first picture:<|vision_start|>" + "<|image_pad|>" * pads[0] + "<|vision_end|>"
            "and the second:<|vision_start|>" + "<|image_pad|>" * pads[1] + "<|vision_end|>"
            "What differs between them?<|im_end|>\n<|im_start|>assistant\n")
    return tok.encode(text, add_special_tokens=False).ids


def prompt_video(tok: Tokenizer, grid: torch.Tensor) -> list[int]:
    per_frame = int(grid[1] * grid[2]) // 4
    frames = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame + "<|vision_end|>"
                     for t in (0.5, 1.5))
    text = "<|im_start|>user\n" + frames + "What happens?<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False).ids


def token_types(ids: list[int], config) -> torch.Tensor:
    return torch.tensor([[1 if i == config.image_token_id else 2 if i == config.video_token_id else 0 for i in ids]])


@torch.no_grad()
def run_case(model, config, ids: list[int], vision_inputs: dict, generate: bool) -> dict:
    visual = model.model.visual
    input_ids = torch.tensor([ids])
    types = token_types(ids, config)
    image_grid = vision_inputs.get("image_grid_thw")
    video_grid = vision_inputs.get("video_grid_thw")
    positions, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=image_grid, video_grid_thw=video_grid)
    grid = image_grid if image_grid is not None else video_grid
    decoder_input = {}

    def keep_input(module, args, kwargs):
        decoder_input["embeddings"] = kwargs["inputs_embeds"][0].detach().clone()

    hook = model.model.language_model.register_forward_pre_hook(keep_input, with_kwargs=True)
    with VisionRecorder(visual) as vrec, mt.Recorder(model, config) as rec:
        rec.active = True
        out = model(input_ids=input_ids, mm_token_type_ids=types, use_cache=False, **vision_inputs)
        rec.active = False
    hook.remove()
    t = dict(vrec.t)
    t["vision.pos_embed"] = pos_embed(visual, grid)
    # The decoder's input: the token embeddings with the merger's rows in place of the image (video) tokens.
    t["embeddings"] = decoder_input["embeddings"]
    for k, v in rec.t.items():
        if k == "final_norm" or (k.startswith("layers.") and k.endswith(".output")):
            t[k] = v
    t["logits"] = out.logits[0].clone()
    t["positions"] = positions[:, 0].clone()
    t["token_ids"] = input_ids[0].clone()
    t["mm_token_type_ids"] = types[0].to(torch.int64)
    for k, v in vision_inputs.items():
        t[k] = v.clone()
    if generate:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = config.text_config.pad_token_id
        gen = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                             do_sample=False, num_beams=1, max_new_tokens=NUM_GENERATED, use_cache=True,
                             return_dict_in_generate=True, output_logits=True, **vision_inputs)
        seq = gen.sequences[0, len(ids):]
        step = torch.stack([x[0] for x in gen.logits])
        assert torch.equal(step.argmax(-1), seq), "generate() is not greedy"
        top = step.double().topk(2, dim=-1).values
        margin = float((top[:, 0] - top[:, 1]).min())
        assert margin > 1e-2, f"a greedy step is a near tie ({margin})"
        t["generated"] = seq.clone()
        t["step_logits"] = step.clone()
    return t


def main() -> None:
    mt.set_determinism()
    root = mt.TESTDATA.parent
    model_dir = mt.TESTDATA / "models" / NAME
    image_dir = mt.TESTDATA / "images"
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    image_dir.mkdir(exist_ok=True)

    tok = build_tokenizer(model_dir)
    special = {t: tok.token_to_id(t) for t in ["<|endoftext|>"] + VISION_TOKENS}
    vocab = tok.get_vocab_size(with_added_tokens=True)
    text = dict(mt.COMMON_TEXT, **TEXT, vocab_size=vocab, bos_token_id=None, eos_token_id=special["<|endoftext|>"],
                pad_token_id=special["<|endoftext|>"])
    config = Qwen3_5Config(
        text_config=dict(model_type="qwen3_5_text", **text),
        vision_config=dict(model_type="qwen3_5_vision", **VISION),
        tie_word_embeddings=False,
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    mt.reinit(model, config, SEED)
    reinit_vision(model.model.visual, SEED + 1)
    mt.round_params_to_bf16(model)
    spec = {"format": "full"}
    mt.save_full_checkpoint(NAME, spec, model, config, model_dir, SEED)
    build_tokenizer(model_dir)  # save_full_checkpoint copied the text-only tokenizer over it
    write_json(model_dir / "preprocessor_config.json", PREPROCESSOR)

    images = draw_images(image_dir)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    pil = [Image.open(images[n]).convert("RGB") for n in ("wide", "small")]
    processed = processor(images=pil, return_tensors="pt")
    image_inputs = {"pixel_values": processed["pixel_values"].float(), "image_grid_thw": processed["image_grid_thw"]}
    gen = torch.Generator().manual_seed(SEED + 2)
    video_grid = torch.tensor([[2, 4, 6]])
    patch_dim = 3 * 2 * 4 * 4
    video_inputs = {"pixel_values_videos": torch.randn(int(video_grid.prod()), patch_dim, generator=gen),
                    "video_grid_thw": video_grid}

    model = mt.load_checkpoint(spec, model_dir)
    cases = {"images": (prompt_images(tok, image_inputs["image_grid_thw"]), image_inputs),
             "video": (prompt_video(tok, video_grid[0]), video_inputs)}
    f32, f64 = {}, {}
    for case, (ids, inputs) in cases.items():
        for k, v in run_case(model, model.config, ids, inputs, generate=True).items():
            f32[f"{case}.{k}"] = v
    model = model.double()
    with mt.true_float64():
        for case, (ids, inputs) in cases.items():
            inputs64 = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
            for k, v in run_case(model, model.config, ids, inputs64, generate=False).items():
                f64[f"{case}.{k}"] = v
    for k, v in f32.items():
        if v.is_floating_point():
            assert v.dtype == torch.float32, (k, v.dtype)
    for k, v in f64.items():
        if v.is_floating_point():
            assert v.dtype == torch.float64, (k, v.dtype)
    for k in f64:
        if f64[k].is_floating_point() and k in f32:
            scale = f64[k].abs().max().item()
            err = (f32[k].double() - f64[k]).abs().max().item() / max(scale, 1e-30)
            assert err < 1e-4, f"{k}: f32 and f64 goldens differ by {err:.2e} of the scale"
    meta = {"model": NAME, "producer": "scripts/make_vision_goldens.py", "cases": ", ".join(cases)}
    outs = {}
    for suffix, tensors in (("", f32), (".f64", f64)):
        out = mt.TESTDATA / "goldens" / f"{NAME}{suffix}.safetensors"
        mt.save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, out, metadata=meta)
        mt.canonicalize_safetensors_header(out)
        outs[suffix] = out

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "safetensors": mt.dist_version("safetensors"), "numpy": np.__version__, "pillow": PIL.__version__}
    section = {
        "generator": "scripts/make_vision_goldens.py",
        "requirements": "scripts/requirements.txt",
        "versions": versions,
        "model": f"testdata/models/{NAME}",
        "seed": SEED,
        "vision_init": VISION_INIT,
        "settings": {"torch_threads": 1, "attn_implementation": "eager", "dtype": "float32 and float64",
                     "image_processor": "Qwen2VLImageProcessorPil (bicubic)", "generated": NUM_GENERATED},
        "cases": {
            "images": "two images (testdata/images/wide.png 37x29, small.png 20x13) in one prompt",
            "video": "two frames of random patches, video_grid_thw [2, 4, 6], timestamps between the frames",
        },
        "grids": [list(map(int, g)) for g in image_inputs["image_grid_thw"]],
    }
    for path in sorted(model_dir.iterdir()):
        add_golden(path, "vision_goldens", section)
    for path in images.values():
        add_golden(path, "vision_goldens", section)
    for out in outs.values():
        add_golden(out, "vision_goldens", section)
        print(f"wrote {out.relative_to(root)} ({out.stat().st_size} bytes, sha256 {mt.sha256(out)})")


if __name__ == "__main__":
    main()
