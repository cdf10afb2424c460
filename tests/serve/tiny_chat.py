"""A tiny random Llama checkpoint with a word-level tokenizer and a chat template, saved
locally (no download) for the server tests.

The vocabulary is the special tokens, the chat template's words and fixed-width filler
words `w00`..`w88`, so no token's text contains another's and decoded text splits back
into ids.
"""

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tests.models import hf_tiny

SPECIAL = ("<unk>", "<s>", "</s>")
BOS, EOS = 1, 2
VARIANT = "llama_gqa"
VOCAB_SIZE = hf_tiny._COMMON["vocab_size"]
WORDS = (*SPECIAL, "user", "assistant", "system", ":")
WORDS = WORDS + tuple(f"w{i:02d}" for i in range(VOCAB_SIZE - len(WORDS)))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
    "{{ eos_token }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Word-level: whitespace-split words, `<s>` prepended, tokens joined by spaces."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save(directory) -> None:
    """Writes config.json, model.safetensors and the tokenizer files into `directory`."""
    model = hf_tiny.build(VARIANT)
    assert model.config.vocab_size == len(WORDS)
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)


def words(ids) -> str:
    """The text the server returns for token ids (special tokens are not shown)."""
    return " ".join(WORDS[t] for t in ids if WORDS[t] not in SPECIAL)
