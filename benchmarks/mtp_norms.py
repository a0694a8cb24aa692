"""MTP head with vs without the input norms (enorm/hnorm): same data, same budget, several seeds.

Trains stories260K heads through the real pipeline (self-distilled data, cached features shared
by every run, so all runs see identical chunks), then measures held-out greedy acceptance at
k = 1, 2, 3 with the MTPHead proposer inside a Generator. On a CUDA machine it also checks that
speculative greedy output equals plain greedy output there.

    python -m benchmarks.mtp_norms --device cpu --steps 1500 --seeds 0,1
    python -m benchmarks.mtp_norms --device cuda --steps 3500 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specdec.cli import bundled_model_path
    from specdec.codec import load_tokenizer
    from specdec.models.loading import load_model
    from specdec.training.data import TrainData, build_chunks
    from specdec.training.features import compute_features
    from specdec.training.mtp import MTPTrainConfig, measure_acceptance, train_mtp

    target, _, path = load_model(bundled_model_path(), dtype="float32", device=args.device)
    tokenizer = load_tokenizer(path)
    work = Path(tempfile.mkdtemp(prefix="mtp-norms-"))
    start = time.perf_counter()
    chunks, prompts = build_chunks(target, tokenizer, TrainData(self_distill_samples=args.samples, distill_tokens=256, chunk_len=256))
    features = compute_features(target, chunks, work / "features", log=None)
    data_s = time.perf_counter() - start  # shared by every run: identical chunks for all
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for norms in (True, False):
            config = MTPTrainConfig(steps=args.steps, batch_size=16, lr=2e-3, warmup_steps=200,
                                    use_input_norms=norms, val_every=10**9, seed=seed)
            result = train_mtp(target, features, config, work / f"seed{seed}-norms{int(norms)}", log=None)
            acc = {f"k={k}": measure_acceptance(result.head, target, prompts, num_speculative_tokens=k, max_new_tokens=64)
                   for k in (1, 2, 3)}
            last = result.history[-1]
            runs.append({
                "seed": seed, "use_input_norms": norms, "train_s": result.train_seconds,
                "final": {k: v for k, v in last.items() if k != "step"},
                "acceptance": {k: v["acceptance_rate"] for k, v in acc.items()},
                "per_position": acc["k=3"]["per_position_acceptance"],
                "mean_accepted_length": {k: v["mean_accepted_length"] for k, v in acc.items()},
            })
            print(runs[-1], flush=True)
    table = {}
    for norms in (True, False):
        mine = [r for r in runs if r["use_input_norms"] == norms]
        table[f"norms={norms}"] = {
            k: statistics.mean(r["acceptance"][k] for r in mine) for k in ("k=1", "k=2", "k=3")
        } | {"final_val_token": statistics.mean(r["final"].get("val_token", float("nan")) for r in mine)}
    exact = _cuda_exactness(work) if args.device.startswith("cuda") else None
    payload = {"machine": machine_info(), "device": args.device, "steps": args.steps, "data_s": data_s,
               "num_chunks": len(chunks), "chunk_len": 256, "runs": runs,
               "mean": table, "cuda_exactness": exact}
    path = write_json("mtp_norms", payload, args.out_dir)
    print(table)
    print(f"wrote {path}")
    return 0


def _cuda_exactness(work: Path) -> dict[str, object]:
    """Speculative (MTP head, k = 1..3) greedy == plain greedy, stories260K float32 on CUDA."""
    from specdec import FixedPolicy, Generator, SamplingParams
    from specdec.cli import bundled_model_path
    from specdec.proposers import MTPHead

    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "Mom said"]
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    plain = Generator.from_pretrained(bundled_model_path(), dtype="float32", device="cuda").generate(prompts, params)
    out = {}
    for k in (1, 2, 3):
        mtp = MTPHead.from_pretrained(work / "seed0-norms1", num_speculative_tokens=k)
        gen = Generator.from_pretrained(bundled_model_path(), dtype="float32", device="cuda", proposer=mtp,
                                        policy=FixedPolicy(k))
        spec = gen.generate(prompts, params)
        out[f"k={k}"] = {"identical": [o.token_ids for o in spec] == [o.token_ids for o in plain],
                         "acceptance_rate": gen.metrics.acceptance_rate}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
