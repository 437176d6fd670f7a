"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat pipeline,
for the clients (coding agents) that speak it: a request becomes a chat request, and its
answer comes back as an Anthropic message, or as Anthropic's event stream."""
