"""OpenAI's Responses API (/v1/responses) over the chat pipeline: a request becomes a chat
request (its input items as messages, after the stored conversation of its
previous_response_id), is rendered, constrained and generated as chat is, and its answer
comes back as Responses output items, or as the typed event stream."""
