"""Front ends of prismdp's engine for other training frameworks: :mod:`prismdp.integrations.hf` (the Hugging Face
``Trainer`` and TRL)."""
