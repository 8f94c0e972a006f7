"""Structured output: grammar-constrained decoding (JSON schema, regex, choice, EBNF) with xgrammar."""
