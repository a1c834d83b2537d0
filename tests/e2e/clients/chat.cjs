// The official openai Node client against Forge: a chat (streamed or not), a tool call, and
// embeddings (the model is then an embedding model).
// node chat.cjs <base-url> <key> <model> <plain|stream|tool|embed>; prints one JSON line.
// CommonJS, so NODE_PATH finds the package where .ci/run installed it (ES modules ignore it).
const OpenAI = require("openai");

const [baseURL, apiKey, model, mode] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const messages = [{ role: "user", content: "What is the service status of checkout?" }];
const tools = [
  {
    type: "function",
    function: {
      name: "get_service_status",
      parameters: {
        type: "object",
        properties: { service: { type: "string" } },
        required: ["service"],
      },
    },
  },
];

async function main() {
  let out;
  if (mode === "stream") {
    const stream = await client.chat.completions.create({
      model, messages, max_tokens: 16, stream: true, stream_options: { include_usage: true },
    });
    let text = "";
    let usage = null;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta?.content ?? "";
      usage = chunk.usage ?? usage;
    }
    out = { text, completion_tokens: usage?.completion_tokens };
  } else if (mode === "tool") {
    const response = await client.chat.completions.create({ model, messages, tools, max_tokens: 64 });
    const call = response.choices[0].message.tool_calls[0];
    out = { name: call.function.name, arguments: JSON.parse(call.function.arguments) };
  } else if (mode === "embed") {
    // The client asks for base64 and decodes it to floats, as the Python client does.
    const response = await client.embeddings.create({ model, input: ["checkout", "payments"] });
    const norms = response.data.map((d) => Math.hypot(...d.embedding));
    out = { count: response.data.length, dims: response.data[0].embedding.length, norms,
            prompt_tokens: response.usage.prompt_tokens };
  } else {
    const response = await client.chat.completions.create({ model, messages, max_tokens: 16 });
    out = { text: response.choices[0].message.content, completion_tokens: response.usage.completion_tokens };
  }
  console.log(JSON.stringify(out));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
