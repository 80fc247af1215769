"""Hugging Face format, both ways: a stage's model and tokenizer exported as a transformers
`LlamaForCausalLM` (or `Qwen2ForCausalLM` when it has q/k/v biases) checkpoint with a
`tokenizer.json` and chat template (export.py), and an HF Llama / Qwen2 checkpoint imported as the
initial checkpoint of a stage (imports.py, from a folder, s3:// or hf://: sources.py)."""
