"""An OpenAI Agents SDK app with one function tool, run unchanged against `ninfer serve`.

    ninfer serve --chat-template presets/templates/qwen3-tools.jinja --api-key secret &
    python scripts/agents_sdk_demo.py --base-url http://127.0.0.1:8080/v1 --api-key secret

The agent is told to call get_weather first (tool_choice names it: the server enforces the call with
a grammar); the SDK runs the tool, sends its output back as a function_call_output Item, resets
tool_choice (its default) and the model answers in text. Prints each step and the final output.
"""
from __future__ import annotations

import argparse
import asyncio
import json

from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

CALLS: list[dict] = []  # what the tool was called with, for the caller to check


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city name.
    """
    CALLS.append({"city": city})
    return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})


def build_agent(base_url: str, api_key: str, model: str) -> Agent:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    return Agent(name="weather", instructions="You answer weather questions with the get_weather tool.",
                 tools=[get_weather], model=OpenAIResponsesModel(model=model, openai_client=client),
                 model_settings=ModelSettings(tool_choice="get_weather", max_tokens=48, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}}))


async def run(base_url: str, api_key: str, model: str, question: str) -> object:
    set_tracing_disabled(True)
    return await Runner.run(build_agent(base_url, api_key, model), question, max_turns=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="secret")
    ap.add_argument("--model", default="", help="the served model id ('' is the loaded model)")
    ap.add_argument("--question", default="What is the weather in Paris?")
    args = ap.parse_args()
    result = asyncio.run(run(args.base_url, args.api_key, args.model, args.question))
    for item in result.new_items:
        print(f"{item.type}: {getattr(item, 'raw_item', item)!s:.200}")
    print("tool calls:", CALLS)
    print("final output:", result.final_output)


if __name__ == "__main__":
    main()
