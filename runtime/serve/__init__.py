"""`streamoe serve`: the HTTP API and chat page (`server.py`, `static/`), the door that guards it (`door.py`), the
engine's worker thread (`worker.py`) and, across ranks, the other ranks repeating its engine calls (`lockstep.py`), the request checks and the APIs translated into the same job
(`openai_api.py`, `responses_api.py`, `anthropic_api.py`), output fields (`chat_output.py`), logprobs, `/metrics`
and the prompt cache. The engine and everything it runs on live one level up, in `runtime/`."""
