"""LoRA through peft ([model.lora], trainer/models/lora.py) in the real sync loop.

A tiny Llama trains LoRA adapters with the transformers generator: checkpoints hold only the
adapters (and their AdamW moments), the base weights never move, a killed run resumes to the
uninterrupted run's bytes, the generator samples from the merged weights (its stored behaviour
log-probs equal the LoRA learner's at staleness 0), and the published folders hold only the
adapters (beside a reference to the base), which an async actor merges into the base and loads. tests/trainer/test_vllm_chat.py runs LoRA through vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch
from helpers import ROOT, inject_fault, require_peft, resumable_run_toml, run_draws, with_eval
from safetensors.torch import load_file

import trainer.run.sync as T
from rolloutstore import RolloutStore
from trainer.algo.logprobs import sequence_logprobs
from trainer.config import ConfigError, TrainConfig
from trainer.models.load import load_model
from trainer.models.lora import LORA_TARGETS, LoraSettings, apply_lora, has_lora, merged_state
from trainer.models.tiny import make_tiny_model
from trainer.rollout.weights import load_published_model, read_published

STEPS = 4
LORA = {"rank": 4, "alpha": 8}


def _toml(run_dir, model_dir, *, steps: int = STEPS) -> str:
    """The run's TOML text (the resume tests' tiny run, on ``model_dir``, with [model.lora])."""
    text = with_eval(
        resumable_run_toml(
            "lora",
            """
updates_per_round = 2
batch_size = 8
checkpoint_every = 2
keep_checkpoints = 10
warm_start_steps = 1
""",
        ),
        every=0,
    ).format(dir=run_dir, steps=steps)
    text = text.replace("[model]\n", f'[model]\npath = "{model_dir}"\ndevice = "cpu"\n', 1)
    return text + "\n[model.lora]\n" + "".join(f"{k} = {v}\n" for k, v in LORA.items())


def _config(run_dir, model_dir, *, steps: int = STEPS, **lora) -> TrainConfig:
    data = tomllib.loads(_toml(run_dir, model_dir, steps=steps))
    data["model"]["lora"].update(lora)
    return TrainConfig.from_dict(data)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    require_peft()
    return make_tiny_model(
        tmp_path_factory.mktemp("lora") / "llama", architecture="llama", num_layers=1,
        num_texts=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, llama):
    """The uninterrupted LoRA run (also the reference of the resume test)."""
    run_dir = tmp_path_factory.mktemp("lora-run") / "run"
    T.train(_config(run_dir, llama), progress=False)
    return run_dir


def _ckpt(run_dir, step: int):
    return run_dir / "checkpoints" / f"step-{step:09d}"


def _lora_model(model_dir, run_dir, step: int):
    """The learner's model at ``step``: the base folder plus that checkpoint's adapters."""
    model, _ = load_model(model_dir)
    model = apply_lora(model, LoraSettings(**LORA), seed=0)
    missing, unexpected = model.load_state_dict(
        load_file(str(_ckpt(run_dir, step) / "model.safetensors")), strict=False
    )
    assert not unexpected and all("lora_" not in k for k in missing)
    return model.eval()


def test_checkpoints_hold_only_the_adapters(run, llama):
    ckpt = _ckpt(run, STEPS)
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    # Every target module of the one layer has its A and B: 7 modules x 2.
    assert len(weights) == 2 * len(LORA_TARGETS)
    assert {k.split(".")[-4] for k in weights} == set(LORA_TARGETS)
    full = (llama / "model.safetensors").stat().st_size
    size = (ckpt / "model.safetensors").stat().st_size
    print(f"LoRA checkpoint weights {size:,} bytes vs full weights {full:,} ({full / size:.0f}x)")
    assert size * 10 < full
    # The optimizer holds the adapters only: one AdamW state per adapter tensor.
    state = torch.load(ckpt / "trainer.pt", weights_only=False)["learner"]["optimizer"]["state"]
    assert len(state) == len(weights)
    assert sum(v["exp_avg"].numel() for v in state.values()) == sum(
        w.numel() for w in weights.values()
    )


def test_base_weights_never_move_and_generators_get_merged_weights(run, llama, tmp_path):
    init = load_file(str(llama / "model.safetensors"))
    folder = max((run / "weights").glob("v-*"), key=lambda p: p.name)
    published = read_published(folder)  # base + the folder's adapters, merged
    # The model's own names: no adapter tensors, no peft prefixes.
    assert set(init) <= set(published) and not has_lora(published)
    # Non-target weights (embeddings, head, norms) are the base's, bit for bit; every target
    # projection moved, and is exactly base + the final adapters' delta.
    targets = {k for k in init if k.split(".")[-2] in LORA_TARGETS}
    assert all(torch.equal(published[k], init[k]) for k in set(init) - targets)
    assert all(not torch.equal(published[k], init[k]) for k in targets)
    lora = _lora_model(llama, run, STEPS)
    merged = merged_state(lora)
    assert all(torch.equal(merged[k], published[k]) for k in published)
    # Publishing a module writes its adapters; a state dict that still holds them is refused.
    from trainer.rollout.weights import publish_weights

    again = publish_weights(tmp_path / "w", STEPS, lora, template=llama)
    assert read_published(again).keys() == published.keys()
    with pytest.raises(ValueError, match="LoRA adapter tensors"):
        publish_weights(tmp_path / "w", STEPS + 1, lora.state_dict(), template=llama)
    # The published folder loads as a normal model (strictly: names and shapes).
    model, _ = load_published_model(folder)
    assert set(model.state_dict()) == set(published)


def test_generator_logprobs_match_the_lora_learner_at_staleness_0(run, llama):
    """Rows of version 2 were sampled from the merged weights of step 2; the LoRA learner's
    own forward (adapters unmerged) at that checkpoint must score them the same."""
    rows = (
        RolloutStore.open(run / "store", create=False)
        .sql(
            "SELECT prompt_ids, completion_ids, behavior_logprobs, temperature FROM rollouts "
            "WHERE policy_version = 2"
        )
        .to_pylist()
    )
    assert rows
    model = _lora_model(llama, run, 2)
    gaps = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            n = len(r["completion_ids"])
            lp = sequence_logprobs(model, ids, temperature=r["temperature"]).logprobs[0, -n:]
            gaps.append((lp - torch.tensor(r["behavior_logprobs"])).abs())
    gap = torch.cat(gaps).max().item()
    print(f"LoRA learner vs transformers generator (merged), staleness 0: max gap {gap:.2e}")
    assert gap < 1e-4
    # The adapters really moved by step 2: the base model alone scores them differently.
    base, _ = load_model(llama)
    with torch.no_grad():
        r = rows[0]
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        lp = sequence_logprobs(base, ids, temperature=r["temperature"]).logprobs[0, 1:]
        lora = sequence_logprobs(model, ids, temperature=r["temperature"]).logprobs[0, 1:]
    assert (lp - lora).abs().max() > 1e-4


class Killed(BaseException):
    """The injected fault (as in test_resume_exact.py)."""


def test_resume_after_a_kill_equals_the_uninterrupted_run(tmp_path, monkeypatch, run, llama):
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, llama)

    def fault(where: str) -> None:
        if where == "step:3":  # after the step-2 checkpoint
            raise Killed(where)

    with monkeypatch.context() as m:
        inject_fault(m, fault)
        with pytest.raises(Killed):
            T.train(cfg, progress=False)
    T.train(cfg, resume=True, progress=False)
    for step in (2, STEPS):
        name = _ckpt(run_dir, step) / "model.safetensors"
        assert name.read_bytes() == (_ckpt(run, step) / "model.safetensors").read_bytes()
    assert run_draws(run_dir) == run_draws(run)
    losses = [
        [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()
         if json.loads(x)["kind"] == "train"]
        for d in (run, run_dir)
    ]  # fmt: skip
    assert losses[1][-1] == losses[0][-1]  # the last step's loss, bit for bit
    final = [max((d / "weights").glob("v-*"), key=lambda p: p.name) for d in (run, run_dir)]
    assert (final[0] / "adapter_model.safetensors").read_bytes() == (
        final[1] / "adapter_model.safetensors"
    ).read_bytes()


def test_resume_refuses_a_checkpoint_of_the_other_kind(tmp_path, run, llama):
    """Adapters-only checkpoints need [model.lora]; full ones refuse it (one clear line).

    A resume refuses the change itself, before it writes anything; a run.json that does not
    match its checkpoints (here edited) is refused when the checkpoint is restored."""
    from trainer.errors import CheckpointError

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = _config(copy, llama)
    data = cfg.to_dict()
    plain = TrainConfig.from_dict({**data, "model": {**data["model"], "lora": None}})
    other = _config(copy, llama, target_modules=["q_proj"])
    with pytest.raises(ConfigError, match=r"resume cannot change \[model\]\.lora \("):
        T.train(plain.with_run(steps=STEPS + 1), resume=True, progress=False)
    with pytest.raises(ConfigError, match=r"resume cannot change \[model.lora\]\.target_modules"):
        T.train(other.with_run(steps=STEPS + 1), resume=True, progress=False)
    meta = json.loads((copy / "run.json").read_text())
    for edited, match in (
        (plain, r"LoRA adapters only.*without \[model.lora\]"),
        (other, r"adapters do not fit"),
    ):
        (copy / "run.json").write_text(json.dumps({**meta, "config": edited.to_dict()}))
        with pytest.raises(CheckpointError, match=match):
            T.train(edited.with_run(steps=STEPS + 1), resume=True, progress=False)


def test_an_actor_loads_the_merged_published_weights(tmp_path, run, llama):
    """An async actor (transformers, [generation].dtype bfloat16 on [model].device cpu) loads
    the LoRA run's published adapter folder merged into its base and samples in bfloat16."""
    from trainer.rollout.hf import logprob_gaps
    from trainer.run.actor import run_actor

    folder = max((run / "weights").glob("v-*"), key=lambda p: p.name)
    cfg = TrainConfig.from_dict({
        **_config(tmp_path / "actor-run", llama).to_dict(),
        "generation": {"backend": "hf", "group_size": 4, "max_tokens": 6, "prompts_per_round": 4,
                       "dtype": "bfloat16"},
    })  # fmt: skip
    weights = tmp_path / "weights"
    shutil.copytree(folder, weights / folder.name)  # as the learner published it
    (weights / "LATEST").write_text(f"{int(folder.name.removeprefix('v-'))}\n")
    meta = {"run_id": "lora", "start_ms": 1_700_000_000_000, "config": cfg.to_dict()}
    (weights / "run.json").write_text(json.dumps(meta))
    store = tmp_path / "store"
    assert run_actor(cfg, 0, weights_dir=weights, store_uri=str(store), max_rounds=1) == 1
    rows = RolloutStore.open(store).sql("SELECT * FROM rollouts").to_pylist()
    assert len(rows) == 4 * 4
    assert (folder / "adapter_model.safetensors").exists()
    assert not (folder / "model.safetensors").exists()
    model, _ = load_published_model(folder)  # float32 merged weights
    gaps = logprob_gaps(model, rows)
    # bfloat16 sampling: gaps of bf16 size against the float32 recomputation (float32 on both
    # sides would be ~1e-6), and bf16-small against a bf16 recomputation.
    assert gaps["max"] > 1e-3 and gaps["clipped_mean"] < 0.02, gaps


def test_lora_settings_are_validated_with_their_key(tmp_path):
    def load(lora) -> TrainConfig:
        return TrainConfig.from_dict({"model": {"lora": lora}})

    cfg = load({"rank": 8})
    assert cfg.model.lora.rank == 8 and cfg.model.lora.target_modules == LORA_TARGETS
    assert TrainConfig().model.lora is None
    # run.json round trip (resume reads it back), off and on.
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig.from_dict(TrainConfig().to_dict()).model.lora is None
    # --set model.lora.rank=4 arrives as a "lora.rank" key of [model].
    assert TrainConfig.from_dict({"model": {"lora.rank": 4}}).model.lora.rank == 4
    for lora, key in [
        ({"rank": 0}, "[model.lora].rank"),
        ({"rank": 2.5}, "[model.lora].rank"),
        ({"alpha": 0}, "[model.lora].alpha"),
        ({"dropout": 1.0}, "[model.lora].dropout"),
        ({"target_modules": []}, "[model.lora].target_modules"),
        ({"target_modules": "q_proj"}, "[model.lora].target_modules"),
        ({"r": 8}, "[model.lora].r: unknown key"),
        (8, "[model.lora] must be a table"),
    ]:
        with pytest.raises(ConfigError) as err:
            load(lora)
        assert str(err.value).startswith(key), (lora, str(err.value))
    with pytest.raises(ConfigError, match=r"\[model.lora\] with \[run\].fsdp"):
        TrainConfig.from_dict({"model": {"lora": {}}, "run": {"fsdp": True}})


def test_target_modules_that_match_nothing_name_the_key(llama):
    model, _ = load_model(llama)
    with pytest.raises(ConfigError, match=r"\[model.lora\].target_modules"):
        apply_lora(model, LoraSettings(target_modules=("no_such_proj",)), seed=0)


def test_lora_without_peft_is_one_line_naming_the_extra(tmp_path):
    """peft made unimportable in a subprocess: the CLI refuses with one line, writes nothing."""
    text = resumable_run_toml("nopeft", "warm_start_steps = 0\n").format(
        dir=tmp_path / "run", steps=1
    )
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(text + "\n[model.lora]\nrank = 4\n")
    code = (
        "import sys; sys.modules['peft'] = None\n"
        "from trainer.cli import main\n"
        f"sys.exit(main(['train', {str(cfg)!r}, '-q']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("error: [model.lora] needs the peft package")
    assert "pip install 'rolloutstore[lora]'" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_ddp_ranks_train_the_same_adapters(tmp_path, llama):
    """torchrun, 2 CPU ranks: the adapters are DDP's only trainable parameters; the ranks'
    merged weights stay identical step by step, and the checkpoint holds the adapters only."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(_toml(tmp_path / "run", llama))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLOUTSTORE_RANK_TRACE": str(tmp_path / "tr")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ROLLOUTSTORE_FAULT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "trainer", "train", str(cfg), "-q"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    traces = [
        [json.loads(x) for x in (tmp_path / "tr" / f"rank-{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert [t["step"] for t in traces[0]] == list(range(1, STEPS + 1))
    assert [t["weights_sha256"] for t in traces[0]] == [t["weights_sha256"] for t in traces[1]]
    assert len({t["weights_sha256"] for t in traces[0]}) == STEPS  # every step moved them
    weights = load_file(str(_ckpt(tmp_path / "run", STEPS) / "model.safetensors"))
    assert len(weights) == 2 * len(LORA_TARGETS) and all("lora_" in k for k in weights)


def test_gpu_check_cpu_with_lora_passes(tmp_path):
    """tools/gpu_check.sh --lora (the GPU check's LoRA variant) at tiny sizes on CPU: the
    staleness-0 gap is measured against the LoRA learner's forward and within the bf16 bound."""
    require_peft()
    p = subprocess.run(
        [str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--lora", "4", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "LoRA rank 4" in p.stdout and p.stdout.rstrip().endswith("PASS"), p.stdout
    weights = load_file(
        str(max((tmp_path / "run" / "checkpoints").glob("step-*")) / "model.safetensors")
    )
    assert weights and all("lora_" in k for k in weights)


ASYNC = """
[model]
num_layers = 1
[model.lora]
rank = 4
alpha = 8
[task]
name = "arith"
options = { max_operands = 2, max_digits = 1, ops = ["+"] }
[generation]
backend = "hf"
group_size = 4
max_tokens = 5
prompts_per_round = 6
batch_prompts = 3
[replay]
window = 64
max_staleness = 2
seed = 1
[optim]
lr = 1e-2
[run]
dir = "DIR"
mode = "async"
steps = 4
batch_size = 8
min_rows = 16
checkpoint_every = 2
[eval]
prompts = 4
every = 0
"""


@pytest.mark.slow
def test_async_lora_run_publishes_adapters_its_actor_samples_from(tmp_path):
    """Async mode: the learner publishes adapter folders; the actor process merges them into the
    base and its stored log-probs are those of the published weights of their version."""
    require_peft()
    from trainer.rollout.hf import logprob_gaps

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(ASYNC.replace("DIR", str(tmp_path / "run")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "trainer", "train", str(cfg), "--actors", "1", "-q"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run_dir = tmp_path / "run"
    weights = load_file(str(_ckpt(run_dir, 4) / "model.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    init = load_file(str(run_dir / "model-init" / "model.safetensors"))
    store = RolloutStore.open(run_dir / "store", create=False)
    checked = 0
    for folder in sorted((run_dir / "weights").glob("v-*")):
        published = read_published(folder)  # the base's names, adapters merged
        assert set(init) <= set(published) and not has_lora(published)
        assert not (folder / "model.safetensors").exists()  # adapters only on disk
        version = int(folder.name.removeprefix("v-"))
        rows = store.sql(
            "SELECT * FROM rollouts WHERE policy_version = ?", params=[version]
        ).to_pylist()
        if rows:
            model, _ = load_published_model(folder)
            assert logprob_gaps(model, rows)["max"] < 1e-4
            checked += 1
    assert checked >= 1
