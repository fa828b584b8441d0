"""Text: pretrained Hugging Face encoders for DP fine-tuning (:mod:`.hf`)."""
