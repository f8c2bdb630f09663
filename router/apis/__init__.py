"""The APIs besides completions and chat that vLLM serves, converted to the chat requests vLLM
renders them as, one module per API (pure): ``responses`` (OpenAI Responses, ``/v1/responses``)
and ``messages`` (Anthropic Messages, ``/v1/messages``); ``affinity`` keeps which replica holds a
stored response (Redis I/O); ``error_shapes`` each API's error answers; ``pooling``, ``aliases``,
``lora_load`` and ``images`` the other paths and routing inputs. The package itself imports
nothing: ``router.request.prompts`` imports ``router.apis.images``, and the API modules import the
prompts.
"""
