"""Fine-tuning data: the loss mask found through the chat template, records from JSONL
files, folders and Hugging Face datasets, and bad records reported by line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from finetune_helpers import image_file, one_image_record, small_dataset, write_jsonl
from tiny import make_image
from user_environment import user_environment
from mlxvlm import load
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.errors import MlxvlmError
from mlxvlm.finetune.data import BadRecordsError, looks_like_a_path, open_records
from mlxvlm.finetune.dataset import encode_record, prepare_examples
from mlxvlm.finetune.masking import MaskingError, encode_conversation

FAMILY = "qwen2_vl"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints.path(FAMILY, "hub")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load(checkpoint)[1]


def masked_text(processor, encoded) -> str:
    return processor.tokenizer.decode(encoded.input_ids[encoded.loss_mask].tolist())


def test_mask_covers_every_assistant_reply_and_nothing_else(processor):
    # Two turns, an image in each user turn (of different sizes), and a user turn that
    # repeats the first reply word for word: only the replies may be masked in.
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red cat."},
        {"role": "user", "content": [{"type": "text", "text": "A red cat."}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A small house."}]},
    ]
    images = [make_image(56, 56, seed=1), make_image(112, 56, seed=2)]
    encoded = encode_conversation(processor, messages, images)

    assert masked_text(processor, encoded) == "A red cat.<|im_end|>\nA small house.<|im_end|>\n"
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = encoded.features["image_grid_thw"]
    assert (encoded.input_ids == image_token).sum() == int(np.prod(grid, axis=1).sum()) // 4
    assert not encoded.loss_mask[encoded.input_ids == image_token].any()
    # The ids are exactly what inference feeds the model for the same conversation.
    rendered = processor.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[rendered], images=images, return_tensors="np")["input_ids"][0]
    np.testing.assert_array_equal(encoded.input_ids, expected)


def test_a_conversation_without_an_assistant_reply_is_refused(processor):
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(MaskingError, match="no assistant turn"):
        encode_conversation(processor, messages, [])


def test_images_named_in_parts_resolve_against_the_file(tmp_path, processor):
    image_file(tmp_path / "pics", "a.png")
    absolute = tmp_path / "elsewhere" / image_file(tmp_path / "elsewhere", "b.png", 84, 56)
    record = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "pics/a.png"},
                                     {"type": "image", "image": str(absolute)},
                                     {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "They differ."}]}
    data = write_jsonl(tmp_path / "data" / "train.jsonl", [record])
    (tmp_path / "data" / "pics").symlink_to(tmp_path / "pics")
    encoded = encode_record(open_records(data)[0], processor)
    assert encoded.features["image_grid_thw"].shape[0] == 2
    assert masked_text(processor, encoded) == "They differ.<|im_end|>\n"


def bad_records_file(directory):
    image_file(directory / "images", "ok.png")
    good = one_image_record("images/ok.png", "A red cat.")
    return write_jsonl(directory / "train.jsonl", [
        good,                                                          # line 1
        '{"messages": [oops',                                          # line 2
        one_image_record("images/missing.png", "A blue mat."),         # line 3
        {"messages": [{"role": "user", "content": "Hi"}]},             # line 4
        one_image_record("images/ok.png", "The quick brown fox. " * 40),  # line 5: too long
        good,                                                          # line 6
        {"messages": [{"role": "user", "content": 5},                   # line 7
                      {"role": "assistant", "content": "Five."}]},
    ])


def test_bad_records_are_listed_by_line(tmp_path, processor):
    data = bad_records_file(tmp_path)
    with pytest.raises(BadRecordsError) as error:
        prepare_examples(open_records(data), processor, max_seq_length=200)
    located = {str(bad.location).rsplit(":", 1)[1]: bad.reason for bad in error.value.bad}
    assert set(located) == {"2", "3", "4", "5", "7"}
    assert "JSON" in located["2"]
    assert "missing.png" in located["3"]
    assert "assistant" in located["4"]
    assert "--max-seq-length 200" in located["5"]
    assert "--skip-bad-records" in str(error.value)

    kept = prepare_examples(open_records(data), processor, max_seq_length=200,
                            skip_bad_records=True)
    assert [e.record for e in kept.examples] == [0, 4]  # lines 1 and 6 (line 2 never parsed)
    assert len(kept.skipped) == 5


def test_cli_stops_on_bad_records_with_one_line(tmp_path, checkpoint):
    data = bad_records_file(tmp_path)

    def run(output: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mlxvlm.finetune", "--model", str(checkpoint), "--data",
             str(data), "--output", str(tmp_path / output), "--iters", "1",
             "--max-seq-length", "200", *flags],
            capture_output=True, text=True, timeout=300, env=user_environment())

    # Two independent runs (each its own output folder), side by side.
    with ThreadPoolExecutor(1) as alongside:
        skipped_run = alongside.submit(run, "skipped", "--skip-bad-records")
        stopped = run("stopped")
        skipped = skipped_run.result()
    assert stopped.returncode == 2
    error_lines = [l for l in stopped.stderr.splitlines() if l.startswith("error:")]
    assert len(error_lines) == 1 and "train.jsonl:3" in error_lines[0]
    assert not (tmp_path / "stopped" / "adapter_model.safetensors").exists()

    assert skipped.returncode == 0, skipped.stderr
    assert "skipped" in skipped.stderr and "train.jsonl:4" in skipped.stderr
    assert (tmp_path / "skipped" / "adapter_model.safetensors").exists()
    # Written to a pipe, the progress is plain lines, not a bar's redraws.
    assert "\r" not in skipped.stderr
    progress = [l for l in skipped.stderr.splitlines() if l.startswith("Training: ")]
    assert progress and progress[-1].startswith("Training: 1/1 steps (100%)"), skipped.stderr


@pytest.mark.parametrize("spec", ["data/", "./data", "~/no-such-data", "/no/such/data",
                                  "some/nested/data", "train.jsonl", "owner/train.jsonl"])
def test_a_data_spec_that_is_a_path_is_never_taken_for_a_hub_dataset(spec):
    assert looks_like_a_path(spec)


@pytest.mark.parametrize("spec", ["mnist", "HuggingFaceM4/ChartQA", "HuggingFaceM4/ChartQA:val",
                                  "org/name.v2"])
def test_hub_dataset_ids_are_hub_datasets(spec):
    assert not looks_like_a_path(spec)


def test_cli_says_a_missing_data_folder_does_not_exist(tmp_path, checkpoint):
    """The newcomer's mistake: --data data/ run where there is no data/ (offline, so that
    a Hub look-up could not pass unnoticed)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: without torch (faster)
    for spec, says in (
        ("data/", ["--data data/: no such folder or file", str(tmp_path / "data"),
                   "train.jsonl"]),
        ("owner/name", ["cannot load dataset 'owner/name' from the Hub",
                        "no folder or file owner/name"]),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mlxvlm.finetune", "--model", str(checkpoint), "--data",
             spec, "--output", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert all(words in lines[0] for words in says), lines[0]


def test_a_folder_without_its_jsonl_names_the_file_and_the_flag(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(MlxvlmError, match=r"^--data .*data: the folder has no train\.jsonl"):
        open_records(tmp_path / "data")
    (tmp_path / "data" / "train.jsonl").write_text("")
    with pytest.raises(MlxvlmError, match=r"^--val-data .*: the folder has no valid\.jsonl"):
        open_records(tmp_path / "data", split="validation", flag="--val-data")
    with pytest.raises(MlxvlmError, match=r"^--val-data .*missing: no such folder or file"):
        open_records(tmp_path / "missing", split="validation", flag="--val-data")


def test_folder_with_train_and_valid_files(tmp_path, checkpoint):
    small_dataset(tmp_path / "data", count=4)
    (tmp_path / "data" / "valid.jsonl").write_text(
        "\n".join((tmp_path / "data" / "train.jsonl").read_text().splitlines()[:2]) + "\n")
    reports = []

    class Recorder:
        def on_train_loss_report(self, info):
            reports.append(("train", info))

        def on_val_loss_report(self, info):
            reports.append(("val", info))

    result = finetune(FinetuneConfig(model=str(checkpoint), data=str(tmp_path / "data"),
                                     output=str(tmp_path / "out"), batch_size=2, iters=2,
                                     steps_per_eval=1, learning_rate=1e-3), callback=Recorder())
    assert result.val_loss is not None and np.isfinite(result.val_loss)
    assert [kind for kind, _ in reports] == ["val", "train", "val", "train", "val"]
    train = [info for kind, info in reports if kind == "train"]
    assert [info["iteration"] for info in train] == [1, 2]
    assert all(info["tokens_per_second"] > 0 and info["peak_memory"] > 0 for info in train)


def test_hugging_face_dataset_in_trl_layout(tmp_path, checkpoint):
    datasets = pytest.importorskip("datasets")
    rows = [{
        "messages": [
            {"role": "user", "content": [{"type": "image", "text": None},
                                         {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [make_image(56, 56, seed=i)],
    } for i, answer in enumerate(["A red cat.", "A small house.", "A blue mat."])]
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"),
                                   "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image()),
    })
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "ds"))

    records = open_records(tmp_path / "ds")
    assert len(records) == 3 and records[1].location.endswith("row 1")
    result = finetune(FinetuneConfig(model=str(checkpoint), data=str(tmp_path / "ds"),
                                     output=str(tmp_path / "out"), batch_size=3, iters=1))
    assert result.train_examples == 3
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16


@pytest.mark.parametrize("kind", ["tokenizer_bos", "template_bos"])
def test_training_ids_start_as_inference_prompts_do(tiny_checkpoints, kind):
    """A tokenizer that adds BOS: training examples carry the one BOS that inference's
    prompts carry (neither lost nor doubled), and the loss mask still covers the reply."""
    from mlxvlm.prompt import prepare_inputs

    model, processor = load(tiny_checkpoints.bos_variant("llava", kind))
    bos = processor.tokenizer.bos_token_id
    question = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What is it?"}]}]
    reply = {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}
    image = make_image(64, 64)
    encoded = encode_conversation(processor, [*question, reply], [image])
    prompt = prepare_inputs(processor, question, [image], feature_names=model.feature_names)
    prompt_ids = prompt.input_ids[0].tolist()
    assert prompt_ids.count(bos) == 1 and prompt_ids[0] == bos
    assert encoded.input_ids.tolist()[: len(prompt_ids)] == prompt_ids
    assert "A red square." in masked_text(processor, encoded)
    assert not encoded.loss_mask[: len(prompt_ids)].any()
