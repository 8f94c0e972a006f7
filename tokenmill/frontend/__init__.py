"""The front-end process: tokenize, send requests to the engine core, detokenize.

`async_llm` (server) and `llm_engine` (offline, sync, core in-process) turn
prompts into `EngineCoreRequest`s (`input_processor`, `chat_template`) and the
core's `EngineCoreOutputs` into `RequestOutput`s (`output_processor`,
`detokenizer`, `stop_checker`, `logprobs`, `parallel_sampling`);
`core_client` spawns the engine-core process and talks to it.
"""
