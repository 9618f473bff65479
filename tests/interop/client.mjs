// The TypeScript SDK's MCP client (pinned in package.json) against the gateway: a second
// implementation that must interoperate. tests/e2e/test_interop.py runs it and checks what
// it prints: one JSON object, what each step saw. Nothing here asserts; the test does.
//
//   node client.mjs '{"transport": "stdio", "command": "...", "args": [...], "env": {...},
//                     "mode": "legacy" | "auto"}'
//   node client.mjs '{"transport": "http", "url": "http://127.0.0.1:PORT/mcp",
//                     "token": "...", "mode": "legacy" | "auto"}'
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { StdioClientTransport } from "@modelcontextprotocol/client/stdio";
import { z } from "zod";

const CALL_TIMEOUT_MS = 120_000; // a kernel's start is in the first call
const config = JSON.parse(process.argv[2]);

function transport() {
  if (config.transport === "stdio") {
    return new StdioClientTransport({
      command: config.command,
      args: config.args,
      env: config.env,
      stderr: "inherit",
    });
  }
  return new StreamableHTTPClientTransport(new URL(config.url), {
    requestInit: { headers: { Authorization: `Bearer ${config.token}` } },
  });
}

function texts(result) {
  return (result.content ?? []).filter((c) => c.type === "text").map((c) => c.text);
}

async function main() {
  const seen = {};
  const client = new Client(
    { name: "mcp-forge-interop", version: "1.0.0" },
    { versionNegotiation: { mode: config.mode ?? "legacy" } },
  );
  const logged = []; // output as log messages (up to 2025-11-25)
  client.setNotificationHandler("notifications/message", (n) =>
    logged.push({ level: n.params.level, logger: n.params.logger ?? null, data: n.params.data }),
  );
  await client.connect(transport());
  seen.protocolVersion = client.getNegotiatedProtocolVersion?.() ?? null;
  seen.server = client.getServerVersion();
  seen.capabilities = Object.keys(client.getServerCapabilities() ?? {}).sort();

  const tools = await client.listTools();
  seen.tools = tools.tools.map((t) => t.name).sort();

  // A cell that prints while it runs: progress arrives before the result.
  const progress = [];
  const ran = await client.callTool(
    {
      name: "execute_code",
      arguments: {
        code:
          "import time\nopen('/workspace/interop.txt', 'w').write('from typescript')\n" +
          "for i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.6)\n6 * 7",
      },
    },
    {
      timeout: CALL_TIMEOUT_MS,
      onprogress: (p) => progress.push({ progress: p.progress, message: p.message ?? null }),
    },
  );
  seen.execute = {
    isError: ran.isError ?? false,
    text: texts(ran).join("\n"),
    structured: ran.structuredContent ?? null,
    progress,
    logged: [...logged],
  };
  const sid = ran.structuredContent?.session_id;

  // Cancellation: a long cell given up on after its first progress. The gateway interrupts
  // the kernel, so the next call runs at once and the variable set after the sleep is unset.
  const abort = new AbortController();
  const started = Date.now();
  let cancelled = null;
  try {
    await client.callTool(
      {
        name: "execute_code",
        arguments: { code: "import time\ntime.sleep(60)\nafter_sleep = 1", session_id: sid },
      },
      { timeout: CALL_TIMEOUT_MS, signal: abort.signal, onprogress: () => abort.abort("enough") },
    );
    cancelled = "completed";
  } catch (e) {
    cancelled = String(e?.name ?? e);
  }
  const next = await client.callTool(
    { name: "execute_code", arguments: { code: "'after_sleep' in globals()", session_id: sid } },
    { timeout: CALL_TIMEOUT_MS },
  );
  seen.cancel = {
    outcome: cancelled,
    seconds: (Date.now() - started) / 1000,
    next: texts(next).join("\n"),
    nextIsError: next.isError ?? false,
  };

  // A task (2025-11-25 only): answered at once, its result fetched when done. The SDK makes
  // no tasks itself: plain requests, each result checked by the test, not by a schema here.
  if (seen.protocolVersion === "2025-11-25") {
    const any = z.looseObject({});
    const created = await client.request(
      {
        method: "tools/call",
        params: {
          name: "execute_code",
          arguments: { code: "import time\ntime.sleep(1)\n6 * 7", session_id: sid },
          task: { ttl: 60_000 },
        },
      },
      any,
    );
    const id = created.task?.taskId;
    const got = await client.request({ method: "tasks/get", params: { taskId: id } }, any);
    const result = await client.request({ method: "tasks/result", params: { taskId: id } }, any, {
      timeout: CALL_TIMEOUT_MS,
    });
    seen.task = {
      created: created.task?.status ?? null,
      got: got.status ?? null,
      value: result.structuredContent?.result?.data?.["text/plain"] ?? null,
      related: result._meta?.["io.modelcontextprotocol/related-task"]?.taskId === id,
    };
  }

  // A resource read: the file the first cell wrote, and the session's notebook.
  const file = await client.readResource({ uri: `forge://sessions/${sid}/files/interop.txt` });
  seen.resource = file.contents.map((c) => c.text ?? null);
  const listed = await client.listResources();
  seen.resources = listed.resources.map((r) => r.uri);

  await client.callTool({ name: "close_session", arguments: { session_id: sid } });
  await client.close();
  process.stdout.write(JSON.stringify(seen) + "\n");
}

main().catch((e) => {
  process.stderr.write(`interop client failed: ${e?.stack ?? e}\n`);
  process.exit(1);
});
