#!/usr/bin/env python3
"""A golden for a long prompt: 1000 tokens of plain text on the tiny model, past every block and cache boundary the
chat prompts (100 to 160 tokens) reach.

Writes testdata/goldens/tiny.long.safetensors from testdata/models/tiny (run scripts/make_testdata.py first), with
transformers in f32 eager and fla hidden exactly as make_testdata.py does. The text below is tokenized with the
tiny tokenizer (no chat template) and cut to its first T = 1000 tokens: at the static graphs' default context of
1024 and blocks of 64 that is 15 full blocks and a padded one of 40, and 16 greedy tokens still fit.

Tensors: `token_ids` i64 [T], `logits` [T, V], `final_norm` [T, H], `layers.{i}.output` [T, H], the states after
the prompt (`layers.{i}.conv_state`, `layers.{i}.recurrent_state`, `layers.{i}.key_cache`, `layers.{i}.value_cache`),
and `generated` i64 [16], the greedy continuation (eos disabled), whose top1-top2 logit margins are checked here.

The file's own metadata records only the model, the producer and T; the versions go to testdata/manifest.json with
the file's size and sha256 (its entry in `files` and a `long_goldens` section). make_testdata.py rewrites the
manifest without them, so run this script after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_testdata as mt  # noqa: E402  (hides fla before transformers is imported)
from testdata_files import add_golden  # noqa: E402

import json  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

T = 1000
MIN_GREEDY_MARGIN = 1e-2  # top1 - top2 over the 16 greedy steps, as make_testdata.py's MIN_MARGIN

# Written for this project.
TEXT = """\
The ferry to the island leaves twice a day, once at seven in the morning and once at four in the afternoon. In
summer the morning boat is full of walkers with heavy packs, families with cool boxes and a few workers who keep the
lighthouse and the small harbour in order. In winter it is almost empty, and the crew know every passenger by name.

On the island there is one road. It starts at the harbour, climbs past the school and the chapel, and ends at the
old signal station on the cliff. Nobody drives fast on it, because sheep sleep on the warm tarmac and the bends are
sharp. The post van comes over on the morning ferry, does its round, and goes back at four with the letters.

The school has nine children this year. Their teacher came from the mainland eleven years ago for a single term and
never left. She teaches reading and numbers in the mornings, and in the afternoons the older children help with the
weather records: rain in the copper gauge, wind from the vane on the roof, the height of the tide at noon. The
records go back to the year the school was built, and the children like to find the stormiest day in each decade.

Last spring the records showed something odd. The tide at noon had been higher than the tables predicted on twenty
days in a row. The children checked the gauge, then checked it again with a rope and a stone, and found the same
numbers. Their teacher wrote to the harbour office on the mainland. A week later an engineer arrived on the morning
ferry with a box of instruments and a flask of tea, and spent three days walking along the shore.

She found that a sand bar at the mouth of the bay had moved. A winter storm had pushed it north by almost a hundred
metres, and the water now came into the bay a little later and stayed a little longer. The tables were not wrong,
she said, they were only old. She showed the children how the tables are made: from many years of measurements, a
sum of slow waves, each with its own period, added together to give the height of the water at any hour.

The children asked whether their records could help. The engineer said that nine years of careful numbers were worth
more than a new instrument, and she took copies back with her. In the autumn a letter came. The new tables for the
bay used the school's records, and the children's names were printed on the last page, in small letters, under a
line that thanked the observers of the island school.

Now the children measure more than before. They write down the time of high water as well as its height, the colour
of the sea, and the number of boats in the harbour. Some of these numbers will never be used for anything, their
teacher says, and that is fine: you cannot know in advance which ones will matter. The point is to measure the same
way every day, so that when something changes, you can see it.

In the evenings the harbour is quiet. The four o'clock ferry has gone, the gulls settle on the breakwater, and the
lighthouse begins to turn. From the signal station you can see the lights of the mainland, low on the horizon, and
on clear nights the slow beam of the next lighthouse along the coast, answering.

The islanders say that the sea keeps its own accounts. It takes a little of the cliff each winter and gives back a
little sand to the beach each summer, and over a lifetime the shore moves less than you would think. But it does
move, and the school's copper gauge and the children's careful pencil marks are how the island keeps its side of the
books. Every evening, before the light goes, somebody walks down to the harbour wall and reads the gauge once more.
"""


@torch.no_grad()
def run(model, config, ids: torch.Tensor, pad_id: int) -> dict:
    res = mt.run_f32(model, config, ids[None], pad_id)
    t = res["tensors"]
    keep = {
        k: v
        for k, v in t.items()
        if k in ("token_ids", "logits", "final_norm", "generated")
        or (k.startswith("layers.") and k.rsplit(".", 1)[1] in ("output", "conv_state", "recurrent_state",
                                                               "key_cache", "value_cache"))
    }
    margins = mt.margins(res["step_logits"])
    assert margins.min().item() > MIN_GREEDY_MARGIN, f"greedy margin {margins.min().item():.3g}"
    return {"tensors": keep, "greedy_margin_min": margins.min().item(),
            "prompt_margin_min": mt.margins(t["logits"]).min().item()}


def main() -> None:
    mt.set_determinism()
    transformers.utils.logging.disable_progress_bar()
    root = Path(__file__).resolve().parent.parent
    model_dir = root / "testdata" / "models" / "tiny"
    tok = AutoTokenizer.from_pretrained(model_dir)
    all_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(all_ids) >= T, f"the text has only {len(all_ids)} tokens"
    ids = torch.tensor(all_ids[:T], dtype=torch.long)
    model = mt.load_checkpoint({"format": "text"}, model_dir)
    config = model.config
    special = json.loads((root / "testdata" / "manifest.json").read_text())["tokenizer"]["added_tokens"]
    out_run = run(model, config, ids, special["<|endoftext|>"])
    tensors = {k: v.contiguous() for k, v in out_run["tensors"].items()}
    out = root / "testdata" / "goldens" / "tiny.long.safetensors"
    mt.save_file(tensors, out, metadata={"model": "tiny", "producer": "scripts/make_long_golden.py",
                                         "tokens": str(T)})
    mt.canonicalize_safetensors_header(out)
    add_golden(out, "long_goldens", {
        "generator": "scripts/make_long_golden.py",
        "requirements": "scripts/requirements.txt",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": mt.dist_version("safetensors"),
            "numpy": np.__version__,
        },
        "model": "testdata/models/tiny",
        "token_ids": f"the first {T} tokens of the script's TEXT ({len(all_ids)} tokens), no chat template",
        "settings": {"torch_threads": 1, "attn_implementation": "eager", "dtype": "float32",
                     "num_generated": mt.NUM_GENERATED},
        "min_margin_prompt": out_run["prompt_margin_min"],
        "min_margin_greedy": out_run["greedy_margin_min"],
        "generated": tensors["generated"].tolist(),
    })
    print(f"wrote {out.relative_to(root)} ({out.stat().st_size} bytes, sha256 {mt.sha256(out)}); "
          f"greedy margin {out_run['greedy_margin_min']:.3g}, generated {tensors['generated'].tolist()}")


if __name__ == "__main__":
    main()
