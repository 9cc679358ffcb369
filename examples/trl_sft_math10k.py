"""DP fine-tuning of SmolLM2-135M-Instruct on Math-10K with TRL's SFTTrainer, made private by prismdp.

``private_trainer_class(SFTTrainer)`` puts prismdp's privacy in front of TRL's trainer: TRL prepares the data (it
tokenises prompt/completion records and masks the prompt: completion-only loss), prismdp samples, clips, noises and
accounts.  Packing and padding-free batches are refused (they would join several examples into one sequence).

    python examples/trl_sft_math10k.py --data ../shared/data/math/math_10k.json --output_dir runs/trl-math \\
        --max_steps 10 --per_device_train_batch_size 4 --learning_rate 3e-4 --use_cpu \\
        --target_epsilon 6 --expected_batch_size 16
"""

from prismdp.quiet import install as quiet_library_messages

quiet_library_messages()  # first: the harmless messages of the libraries imported below (prismdp.quiet)

from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from prismdp.data import generate_prompt, load_instruct_json  # noqa: E402
from prismdp.data.splits import seeded_subset  # noqa: E402
from prismdp.integrations.hf import PrivacyArguments, private_trainer_class  # noqa: E402
from prismdp.models import load_model  # noqa: E402

PrivateSFTTrainer = private_trainer_class(SFTTrainer)


@dataclass
class ScriptArguments:
    data: str = field(metadata={"help": "LLM-Adapters JSON file (instruction, input, output)"})
    model: str | None = field(default=None, metadata={"help": "default: the packaged SmolLM2-135M-Instruct"})
    examples: int = field(default=512, metadata={"help": "seeded subset of the records"})
    rank: int = field(default=16, metadata={"help": "LoRA rank (the paper's 16)"})


def split_at_token_boundary(prompt: str, output: str) -> dict:
    """The LLM-Adapters prompt ends in "### Response:" plus a newline and indentation, which a BPE tokenizer merges
    with the answer's first token; TRL would then drop that whitespace from the training context. End the prompt at
    the colon (a token boundary) and let the completion carry the whitespace, so prompt + completion is exactly the
    LLM-Adapters text."""
    head = prompt.rstrip()
    return {"prompt": head, "completion": prompt[len(head):] + output}


def main(argv=None):
    script, sft, privacy = HfArgumentParser((ScriptArguments, SFTConfig, PrivacyArguments)) \
        .parse_args_into_dataclasses(argv)
    torch.manual_seed(sft.seed)
    model, tokenizer = load_model(script.model, "causal_lm")
    lora = LoraConfig(r=script.rank, lora_alpha=script.rank, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    records = seeded_subset(load_instruct_json(script.data), script.examples, sft.seed)
    rows = [split_at_token_boundary(generate_prompt({**r, "output": ""}), r["output"]) for r in records]
    trainer = PrivateSFTTrainer(model=model, args=sft, privacy_args=privacy, train_dataset=Dataset.from_list(rows),
                                processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    report = trainer.privacy_report()
    print(f"trained {report.get('steps')} steps; epsilon {report.get('epsilon', float('inf')):.3f} at delta "
          f"{report.get('delta')}; adapter and privacy.json in {sft.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
