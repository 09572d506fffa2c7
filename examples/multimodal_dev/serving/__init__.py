"""The chat-completions endpoint over a checkpoint (tools/serve.py): requests, answers' text."""
