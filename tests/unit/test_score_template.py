"""The shipped Qwen3-Reranker score template (docs/templates/qwen3_reranker.jinja) renders a
(query, document) pair exactly as the model card's prompt is built."""

from __future__ import annotations

from gateway_svc.chat_template import ChatTemplate
from tests.helpers.procs import REPO

# Qwen3-Reranker's model card: prefix + "<Instruct>: ...\n<Query>: ...\n<Document>: ..." + suffix.
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def test_the_qwen3_reranker_template_is_the_model_cards_prompt():
    template = ChatTemplate((REPO / "docs" / "templates" / "qwen3_reranker.jinja").read_text())
    pair = [{"role": "query", "content": "What is the capital of China?"},
            {"role": "document", "content": "The capital of China is Beijing.\nIt is large."}]  # fmt: skip
    body = "<Query>: What is the capital of China?\n<Document>: The capital of China is Beijing.\nIt is large."
    rendered = template.render(pair, add_generation_prompt=False)
    assert rendered == f"{PREFIX}<Instruct>: {DEFAULT_INSTRUCTION}\n{body}{SUFFIX}"
    custom = template.render(pair, add_generation_prompt=False, variables={"instruction": "Find the city"})
    assert custom == f"{PREFIX}<Instruct>: Find the city\n{body}{SUFFIX}"
