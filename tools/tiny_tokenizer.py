"""The byte-level BPE tokenizer every tiny checkpoint shares (tools/tiny_checkpoints.py),
trained offline on the small corpus below: ChatML special tokens and chat template, the
full byte alphabet so that any UTF-8 text encodes without <unk>. Deterministic: two
trainings give the same JSON. The grammar tests use its vocabulary without a model.
A change here changes every checkpoint: bump tiny_checkpoints.VERSION."""

from __future__ import annotations

import functools

UNK, BOS, EOS, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # trained first, so their ids are 0..3
VOCAB_SIZE = 768
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The weather this morning was cold and grey, with a light rain falling over the hills.
By noon the clouds had broken apart and the sun came out, warming the wet streets.
Forecasters expect a high of 18 degrees tomorrow, a low of 7, and winds from the west
at 20 km/h. There is a 40% chance of showers on Thursday, and the weekend should be
dry and bright. In winter the lake freezes; in summer storms roll in after 4 p.m.
Snow, sleet, hail, fog, drizzle, thunder and lightning: every season has its weather.

To make a simple tomato soup, heat two tablespoons of olive oil in a large pot.
Add one chopped onion and three cloves of garlic, and cook them for 5 minutes until soft.
Stir in 800 g of tomatoes, 500 ml of vegetable stock, a pinch of salt and some pepper.
Simmer for 20 minutes, then blend until smooth. Serve it hot with fresh bread and butter.
For a quick dinner, boil the pasta in salted water, fry the mushrooms in a hot pan,
and mix everything with grated cheese, lemon juice and a handful of chopped parsley.
Bake the cake at 180 degrees for 35 minutes; let it cool before you cut it.

In mathematics, a prime number is a natural number greater than 1 that has no
divisors other than 1 and itself. The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23.
The sum of the angles of a triangle is 180 degrees, and the area of a circle is pi
times the square of its radius, where pi = 3.14159... If x + 2 = 5, then x = 3.
A function f maps each input x to exactly one output f(x); for example f(x) = 2x + 1.
The derivative of x^2 is 2x, and the integral of 1/x is the natural logarithm of x.
Matrices can be added, multiplied and inverted; vectors have a length and a direction.
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.5 -7 1/2 50% (a + b) * c = a*c + b*c

def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you tell me a short story?
Assistant: Once upon a time, a small robot lived in a quiet village by the sea.
Every day it walked along the beach, collecting shells and talking to the birds.
One evening a storm came, and the robot helped the fishermen bring their boats home.
After that night, everyone in the village called the robot their friend.
User: Thank you! How many days are in a year?
Assistant: A year has 365 days, or 366 days in a leap year.

Questions, answers, lists and quotes: "yes", 'no', [1, 2, 3], {key: value}, <tag>.
Punctuation matters! Does it? Yes; it does: commas, periods, dashes - and more...
Email me at name@example.com or visit https://example.org/path?query=1&page=2#top.
Unicode text also appears: café, naïve, über, señor, 東京, 你好, Привет, 🙂 and ✓.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    return train_tokenizer_json()


def train_tokenizer_json() -> str:
    """Train the shared BPE tokenizer (uncached; prefer `build_tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet makes every UTF-8 string encodable without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def build_tokenizer():
    """A fresh PreTrainedTokenizerFast around the (once-per-process) trained tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
