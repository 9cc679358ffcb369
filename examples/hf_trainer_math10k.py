"""DP fine-tuning of SmolLM2-135M-Instruct on Math-10K with the Hugging Face Trainer and prismdp's PrivateTrainer.

A plain Trainer script, with two changes: ``PrivateTrainer`` instead of ``Trainer``, and ``PrivacyArguments``.
Everything else (TrainingArguments, a stock collator, the PEFT model, save_model) is the usual Hugging Face code.

    python examples/hf_trainer_math10k.py --data ../shared/data/math/math_10k.json --output_dir runs/hf-math \\
        --max_steps 10 --per_device_train_batch_size 4 --learning_rate 3e-4 --use_cpu \\
        --target_epsilon 6 --expected_batch_size 16 --method prism

Arguments: every TrainingArguments and PrivacyArguments flag (HfArgumentParser), plus ``--data`` (an LLM-Adapters
JSON file), ``--examples`` (a seeded subset), ``--max_length``, ``--model`` (default: the packaged SmolLM2-135M).
"""

from prismdp.quiet import install as quiet_library_messages

quiet_library_messages()  # first: the harmless messages of the libraries imported below (prismdp.quiet)

from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import DataCollatorForSeq2Seq, HfArgumentParser, TrainingArguments  # noqa: E402

from prismdp.data import build_instruct_dataset, load_instruct_json  # noqa: E402
from prismdp.data.splits import seeded_subset  # noqa: E402
from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer  # noqa: E402
from prismdp.models import load_model  # noqa: E402


@dataclass
class ScriptArguments:
    data: str = field(metadata={"help": "LLM-Adapters JSON file (instruction, input, output)"})
    model: str | None = field(default=None, metadata={"help": "model folder, .gguf or hub id (default: packaged "
                                                               "SmolLM2-135M-Instruct)"})
    examples: int = field(default=512, metadata={"help": "seeded subset of the records"})
    rank: int = field(default=16, metadata={"help": "LoRA rank (the paper's 16)"})
    max_length: int = field(default=256, metadata={"help": "tokens per example"})


def main(argv=None):
    script, targs, privacy = HfArgumentParser((ScriptArguments, TrainingArguments, PrivacyArguments)) \
        .parse_args_into_dataclasses(argv)
    torch.manual_seed(targs.seed)
    model, tokenizer = load_model(script.model, "causal_lm")
    lora = LoraConfig(r=script.rank, lora_alpha=script.rank, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    records = seeded_subset(load_instruct_json(script.data), script.examples, targs.seed)
    tokenised = build_instruct_dataset(records, tokenizer, script.max_length, train_on_inputs=True)
    rows = [{k: list(map(int, ex[k])) for k in ("input_ids", "attention_mask", "labels")} for ex in tokenised.examples]
    trainer = PrivateTrainer(model=model, args=targs, privacy_args=privacy, train_dataset=Dataset.from_list(rows),
                             data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
                             processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    report = trainer.privacy_report()
    print(f"trained {report.get('steps')} steps; epsilon {report.get('epsilon', float('inf')):.3f} at delta "
          f"{report.get('delta')}; adapter and privacy.json in {targs.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
