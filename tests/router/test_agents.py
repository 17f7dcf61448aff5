"""Agent frameworks as their users run them against the router: OpenAI's Agents SDK runs an
agent with a function tool to its final answer, through the Responses API and through chat
completions, streamed or not; its structured output type parses; LangChain's tool loop
(`bind_tools` with a named tool_choice, the call run, a ToolMessage, the answer) through
either API."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.support.cluster import MODEL


def run_agent(router, api: str, streamed: bool, **agent_args):
    """The agent's run result, and the cities its weather tool was called with."""
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves the machine
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        model = (
            agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        )(MODEL, client)
        settings = agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="required")
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=model,
            model_settings=settings,
            **agent_args,
        )
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run()), cities


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agent_calls_its_tool_and_answers(router, api):
    """tool_choice "required" forces the first turn's call; the SDK then lets the model choose
    (its reset_tool_choice): it may call again, and answers from the tools' outputs."""
    result, cities = run_agent(router, api, streamed=False)
    assert cities and all(cities)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[-1] == "MessageOutputItem" and len(kinds) == 2 * len(cities) + 1
    assert kinds.count("ToolCallItem") == kinds.count("ToolCallOutputItem") == len(cities)
    outputs = [i.output for i in result.new_items if type(i).__name__ == "ToolCallOutputItem"]
    assert outputs == [f"It is sunny and 21 degrees in {city}." for city in cities]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    streamed, again = run_agent(router, api, streamed=True)
    assert again == cities and streamed.final_output == result.final_output


def test_an_agents_output_type_parses(router):
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        degrees: int = Field(ge=-50, le=50)
        sunny: bool

    result, _ = run_agent(
        router, "responses", streamed=False, output_type=Forecast, tool_use_behavior="run_llm_again"
    )
    assert isinstance(result.final_output, Forecast)


@pytest.mark.parametrize("use_responses_api", [False, True])
def test_langchain_tool_loop(router, use_responses_api):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(
        base_url=f"{router.url}/v1",
        api_key="x",
        model=MODEL,
        temperature=0,
        max_tokens=40,
        max_retries=0,
        use_responses_api=use_responses_api,
    )
    messages = [HumanMessage("What is 6 times 7?")]
    asked = llm.bind_tools([multiply], tool_choice="multiply").invoke(messages)
    (call,) = asked.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    result = ToolMessage(str(multiply.invoke(call["args"])), tool_call_id=call["id"])
    answer = llm.bind_tools([multiply]).invoke([*messages, asked, result])
    assert answer.text.strip() and not answer.tool_calls
