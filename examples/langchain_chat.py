"""LangChain against ``pced serve``: pced's server speaks OpenAI's chat-completions API, so
``langchain-openai``'s ``ChatOpenAI`` works unchanged; PCED options travel in ``extra_body``.

    pced serve mystore &                       # 127.0.0.1:8000
    pip install langchain-openai
    python examples/langchain_chat.py "Who founded the Zorblax Company?"
"""

import sys

from langchain_openai import ChatOpenAI

question = sys.argv[1] if len(sys.argv) > 1 else "In which town was the founder of the Zorblax Company born?"
chat = ChatOpenAI(
    base_url="http://127.0.0.1:8000/v1",
    api_key="unused",  # or the key given to pced serve --api-key
    model="pced",  # the server answers with its own model whatever the name
    max_tokens=64,
    temperature=0,
    extra_body={"pced": {"top_k": 4, "method": "pced"}},  # any pced ask option: method, top_k, gamma, ...
)
for chunk in chat.stream(question):  # tokens as PCED chooses them
    print(chunk.content, end="", flush=True)
print()
reply = chat.invoke(question)  # the whole answer at once (for the per-token trace, POST /v1/pced/answer)
print(reply.content)
