"""The GPU check (issue 15): FlashInfer parity, exactness on CUDA, plain decode speed.

Run by ``benchmarks/gpu/check.sh`` on a lent H200 (random weights only: no checkpoints travel),
or on a CPU with ``--smoke`` (tiny shapes, the torch reference in FlashInfer's place) to check
the script itself. Writes ``<out>/gpu-check.json``. Not yet measured here (not built yet):
the sync-free step.

    python -m benchmarks.gpu.check --out /tmp/out            # on CUDA
    python -m benchmarks.gpu.check --out /tmp/out --smoke    # anywhere
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from pathlib import Path

import torch

from benchmarks.oracle import OracleChain, OracleTree, expected_emitted, greedy_references
from specdec import AdaptivePolicy, FixedPolicy, Generator, SamplingParams
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.graphs import EagerCapture, PassGraphs
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager, KVSpec
from specdec.models.llama import ModelConfig
from specdec.models.loading import model_from_state_dict
from specdec.proposers import DraftModel, EAGLETree, MTPHead, PromptLookup

SHAPES = {  # Qwen2.5-shaped configs (random weights)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=101),
}  # fmt: skip


def _hf_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if shape == "tiny":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(0.3 * torch.randn_like(p))  # sharp enough to disagree with a noisy copy
    return model


def _specdec_model(hf, device: torch.device):
    cfg = ModelConfig.from_hf_config(hf.config)
    return model_from_state_dict(cfg, iter(hf.state_dict().items()), dtype=hf.dtype, device=device)


def _backend(device: torch.device, dtype: torch.dtype):
    if device.type != "cuda":
        return TorchAttentionBackend()  # --smoke: the reference stands in
    from specdec.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device, dtype)


def _generator(model, device: torch.device, *, graphs: bool = False, **kwargs) -> Generator:
    """A generator on the check's backend; with ``graphs`` its decode passes replay CUDA graphs
    (on a CPU, --smoke: the same bucket logic with EagerCapture and the torch backend)."""
    backend = _backend(device, model.dtype)
    if not graphs or device.type == "cuda":
        return Generator.from_components(model, backend=backend, cuda_graphs=graphs, **kwargs)
    gen = Generator.from_components(model, backend=backend, **kwargs)
    torch_backend = TorchAttentionBackend()
    gen.engine.graphs = PassGraphs(model, gen.engine.target_kv, lambda b, r: torch_backend, EagerCapture())
    return gen


def check_parity(device: torch.device) -> dict:
    """FlashInfer against the torch reference on decode, prefill, chain and tree passes."""
    out = {}
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for kind in ("decode", "prefill", "chain", "tree"):
            kv = KVCacheManager(PageAllocator(512), page_size=16)
            spec = KVSpec(name="t", num_layers=1, num_kv_heads=4, head_dim=128, dtype=dtype)
            pool = kv.add_pool(spec, device)
            pool.pool.cache.normal_()
            seqs, rows, starts, masks = [], [], [], []
            for s in range(6):
                kv.add_sequence(s)
                start = int(torch.randint(1, 600, (1,), generator=g))
                q = {"decode": 1, "prefill": int(torch.randint(1, 200, (1,), generator=g)), "chain": 6, "tree": 8}[kind]
                kv.reserve(s, start + q)
                seqs.append(s), rows.append([0] * q), starts.append(0 if kind == "prefill" else start)
                if kind == "tree":
                    parents = [-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, q)]
                    m = torch.eye(q, dtype=torch.bool)
                    for j in range(q):
                        p = parents[j]
                        while p >= 0:
                            m[j, p] = True
                            p = parents[p]
                    masks.append(m)
            layout = kv.build_layout(seqs, rows, starts, tree_masks=masks or None, device=device)
            from specdec.interfaces import AttentionSpec

            attn = AttentionSpec(num_qo_heads=28, num_kv_heads=4, head_dim=128, sm_scale=128**-0.5)
            n = layout.num_tokens
            q_ = torch.randn(n, 28, 128, generator=g).to(device, dtype)
            k_ = torch.randn(n, 4, 128, generator=g).to(device, dtype)
            v_ = torch.randn(n, 4, 128, generator=g).to(device, dtype)
            results = []
            for backend in (TorchAttentionBackend(), _backend(device, dtype)):
                pages = [t.clone() for t in pool.layer(0)]
                plan = backend.plan(layout, attn)
                results.append(backend.run(plan, q_, k_, v_, *pages).float())
            out[f"{kind}-{str(dtype).split('.')[-1]}"] = float((results[0] - results[1]).abs().max())
    return out


def check_exactness(device: torch.device) -> dict:
    """Speculative greedy output equals plain greedy output on the device, per proposer."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = _specdec_model(_hf_model("tiny", dtype, device), device)
    draft_hf = _hf_model("tiny", dtype, device)
    with torch.no_grad():
        for p in draft_hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    draft = _specdec_model(draft_hf, device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 101, (int(n),), generator=g).tolist() for n in (5, 9, 17, 3)]
    prompts = [p + p for p in prompts]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = _generator(target, device).generate(prompts, params)
    graphed = _generator(target, device, graphs=True).generate(prompts, params)
    out = {"plain-graphs": {"identical": [o.token_ids for o in graphed] == [o.token_ids for o in plain]}}
    for graphs in (False, True):
        for name, proposer in (
            ("draft", DraftModel.from_model(draft, num_speculative_tokens=4)),
            ("lookup", PromptLookup(num_speculative_tokens=4)),
        ):
            gen = _generator(target, device, graphs=graphs, proposer=proposer, policy=FixedPolicy(4))
            spec = gen.generate(prompts, params)
            out[name + ("-graphs" if graphs else "")] = {
                "identical": [o.token_ids for o in spec] == [o.token_ids for o in plain],
                "drafted": gen.metrics.num_drafted,
                "accepted": gen.metrics.num_accepted,
            }
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_decode_speed(device: torch.device, shape: str, batches: tuple[int, ...], tokens: int) -> dict:
    """Plain decode tokens/s of specdec and of transformers' eager generate, same random weights."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = _hf_model(shape, dtype, device)
    model = _specdec_model(hf, device)
    out = {}
    for batch in batches:
        prompts = [[1 + i, 2, 3, 4] for i in range(batch)]
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        gen = Generator.from_components(model)
        gen.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
        _sync(device)
        start = time.perf_counter()
        eager_out = gen.generate(prompts, params)
        _sync(device)
        ours = batch * tokens / (time.perf_counter() - start)
        graphed_out, graphed_s = _timed_generate(_generator(model, device, graphs=True), prompts, tokens, device)
        ids = torch.tensor(prompts, device=device)
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        _sync(device)
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _sync(device)
        theirs = batch * tokens / (time.perf_counter() - start)
        graphed = batch * tokens / graphed_s
        out[f"batch{batch}"] = {
            "specdec_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs,
            "specdec_graphs_tok_s": graphed, "graphs_ratio": graphed / theirs,
            "graphs_identical": [o.token_ids for o in graphed_out] == [o.token_ids for o in eager_out],
        }  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - (
        model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    )
    out["weight_bytes_read_per_step"] = weight_bytes
    if "batch1" in out:
        step_s = 1 / max(out["batch1"]["specdec_tok_s"], out["batch1"]["specdec_graphs_tok_s"])
        out["batch1_read_GBps"] = weight_bytes / step_s / 1e9
    return out


def _timed_generate(gen: Generator, prompts, tokens: int, device: torch.device):
    """(outputs, seconds) of one generate after a short warm-up on the same prompts."""
    gen.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    _sync(device)
    start = time.perf_counter()
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    _sync(device)
    return outs, time.perf_counter() - start


def _random_prompts(batch: int, vocab: int, length: int = 32, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def check_oracle(device: torch.device, shape: str, tokens: int) -> dict:
    """Speculation with oracle proposers of acceptance alpha (batch 1): speedup over plain, and
    the fraction of the ideal attained. The ideal is the expected emitted tokens per step over
    the step-cost ratio, measured with alpha = 1 (every draft accepted: a speculative step
    costs its emitted tokens over the speedup, in plain steps)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _specdec_model(_hf_model(shape, dtype, device), device)
    vocab = SHAPES[shape]["vocab_size"]
    backend = _backend(device, dtype)
    prompts = _random_prompts(1, vocab)
    plain_gen = Generator.from_components(model, backend=backend)
    refs = greedy_references(plain_gen, prompts, tokens + 24)
    _, plain_s = _timed_generate(plain_gen, prompts, tokens, device)
    out = {"plain_tok_s": tokens / plain_s}
    configs = [("chain", k, None) for k in (3, 5)] + [("tree16", 16, 8)]
    for name, k, levels in configs:
        cost_ratio = None
        for alpha in (1.0, 0.9, 0.8, 0.6):
            make = OracleChain if levels is None else OracleTree
            proposer = make(refs, alpha, k if levels is None else levels, vocab, seed=7)
            gen = Generator.from_components(model, proposer=proposer, policy=FixedPolicy(k), backend=backend)
            outs, seconds = _timed_generate(gen, prompts, tokens, device)
            steps = max(gen.metrics.num_verify_steps, 1)
            emitted = gen.metrics.num_emitted_in_verify / steps
            speedup = plain_s / seconds
            expected = expected_emitted(alpha, k, levels)
            if alpha == 1.0:  # a step's cost in plain steps
                cost_ratio = emitted / speedup
            ideal = expected / cost_ratio
            out[f"{name}-k{k}-a{alpha}"] = {
                "speedup": speedup, "emitted_per_step": emitted, "expected_per_step": expected,
                "step_cost_ratio": cost_ratio, "ideal_speedup": ideal, "fraction_of_ideal": speedup / ideal,
                "identical": outs[0].token_ids == refs[0][len(prompts[0]):][:tokens],
            }  # fmt: skip
    return out


def check_adaptive(device: torch.device, shape: str, batches: tuple[int, ...], tokens: int) -> dict:
    """The adaptive policy (fresh per batch size) against plain decoding, with an oracle
    proposer that pays (alpha 0.8) and one that does not (alpha 0.2); it should never lose
    more than a few percent to plain."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _specdec_model(_hf_model(shape, dtype, device), device)
    vocab = SHAPES[shape]["vocab_size"]
    backend = _backend(device, dtype)
    out = {}
    for batch in batches:
        prompts = _random_prompts(batch, vocab, seed=batch)
        plain_gen = Generator.from_components(model, backend=backend)
        refs = greedy_references(plain_gen, prompts, tokens + 24)
        _, plain_s = _timed_generate(plain_gen, prompts, tokens, device)
        for alpha in (0.8, 0.2):
            proposer = OracleChain(refs, alpha, 6, vocab, seed=batch)
            gen = Generator.from_components(model, proposer=proposer, policy=AdaptivePolicy(), backend=backend)
            outs, seconds = _timed_generate(gen, prompts, tokens, device)
            out[f"batch{batch}-a{alpha}"] = {
                "x_plain": plain_s / seconds, "k_histogram": dict(gen.metrics.k_histogram),
                "identical": [o.token_ids for o in outs] == [r[len(p):][:tokens] for r, p in zip(refs, prompts)],
            }  # fmt: skip
    return out


def _count_syncs(fn) -> tuple[int, list[tuple[str, int]]]:
    """(host syncs, the 5 commonest places) while ``fn`` runs, from CUDA's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{w.filename.split('/src/')[-1]}:{w.lineno}" for w in syncs)
    return len(syncs), where.most_common(5)


def check_host_syncs(device: torch.device) -> dict:
    """Host syncs per speculative step for the MTP head, the EAGLE tree and a draft model on
    stories260K (bundled heads), counted by CUDA's sync debug mode: the baseline that the
    sync-free step (not built yet) is to bring down. On a CPU it only runs the steps."""
    from specdec.cli import bundled_model_path

    path = bundled_model_path()
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    gen = Generator.from_pretrained(path, device=device, dtype=dtype)
    prompts = ["Once upon a time", "The little dog", "Lily saw a", "Tom and his friend"]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    out = {}
    for name, proposer in (
        ("mtp", MTPHead.from_pretrained(path.parent / "stories260K-mtp", num_speculative_tokens=3)),
        ("eagle", EAGLETree.from_pretrained(path.parent / "stories260K-eagle")),
        ("draft", DraftModel.from_pretrained(path, num_speculative_tokens=3, dtype=dtype, device=device)),
    ):
        spec = gen.with_proposer(proposer, policy=3)
        spec.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        before = spec.metrics.num_verify_steps
        if device.type == "cuda":
            syncs, where = _count_syncs(lambda spec=spec: spec.generate(prompts, params))
        else:
            spec.generate(prompts, params)
            syncs, where = None, []
        steps = spec.metrics.num_verify_steps - before
        out[name] = {"steps": steps, "syncs": syncs, "where": where,
                     "syncs_per_step": None if syncs is None else syncs / max(steps, 1)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
                    "torch": torch.__version__}  # fmt: skip
    for name, fn in (
        ("parity", lambda: check_parity(device)),
        ("exactness", lambda: check_exactness(device)),
        ("decode_1.5b", lambda: check_decode_speed(device, "tiny" if args.smoke else "1.5b", (1, 16), 16 if args.smoke else 128)),
        ("decode_7b", lambda: check_decode_speed(device, "tiny" if args.smoke else "7b", (1,), 16 if args.smoke else 128)),
        ("host_syncs", lambda: check_host_syncs(device)),
        ("oracle_1.5b", lambda: check_oracle(device, "tiny" if args.smoke else "1.5b", 16 if args.smoke else 128)),
        ("adaptive_1.5b", lambda: check_adaptive(device, "tiny" if args.smoke else "1.5b", (1, 4) if args.smoke else (1, 4, 16, 32), 12 if args.smoke else 96)),
    ):  # fmt: skip
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name + "_s"] = time.perf_counter() - start
        print(name, json.dumps(report[name])[:400], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu-check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
