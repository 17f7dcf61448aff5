"""The router (`pdserve router`): the OpenAI-compatible front door."""
