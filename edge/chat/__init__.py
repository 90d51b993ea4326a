"""Chat conventions every HTTP front end shares (OpenAI's chat and Responses, Anthropic's
Messages): tool calling (:mod:`edge.chat.tools`, the model's call formats in
:mod:`edge.chat.tool_parsers`) and the reasoning split (:mod:`edge.chat.reasoning`). Knows no
front end; the front ends translate their wire shapes into these."""
