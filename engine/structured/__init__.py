"""Structured answers: response formats and tool calls as grammars, compiled at submit and matched token by token."""
