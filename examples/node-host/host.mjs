// What a host written in Node needs to drive the bridge (or the replay server) from its
// tests: start a command that prints "listening on http://HOST:PORT", parse Server-Sent
// Events by hand, stop the command with SIGTERM. No npm package: node's own fetch,
// child_process and test runner. docs/HOSTS.md describes the contract this relies on.
import { spawn } from "node:child_process";
import { once } from "node:events";
import { createInterface } from "node:readline";

const started = new Set();

/** Start `command args`, resolve once it printed its URL: {child, url, lines, exited}.
 * `killAll()` ends whatever is still running (a test's `after` hook calls it, so that a
 * failed or timed-out test leaves no process behind). */
export async function start(command, args, options = {}) {
  const child = spawn(command, args, { stdio: ["ignore", "pipe", "pipe"], ...options });
  started.add(child);
  child.on("exit", () => started.delete(child));
  const lines = [];
  let stderr = "";
  child.stderr.setEncoding("utf8");
  child.stderr.on("data", (chunk) => { stderr += chunk; });
  const exited = once(child, "exit").then(([code, signal]) => ({ code, signal, stderr }));
  const reader = createInterface({ input: child.stdout });
  const url = await new Promise((resolve, reject) => {
    reader.on("line", (line) => {
      lines.push(line);
      const found = / listening on (http:\/\/\S+)$/.exec(line);
      if (found) resolve(found[1]);
    });
    exited.then(({ code, signal }) =>
      reject(new Error(`${command} exited (${code ?? signal}) before listening: ${stderr}`)));
  });
  return { child, url, lines, exited };
}

/** Stop a started command with SIGTERM: its exit and everything it printed. */
export async function stop(started) {
  started.child.kill("SIGTERM");
  const exit = await started.exited;
  return { ...exit, stdout: started.lines.join("\n") };
}

/** JSON over HTTP: {status, body}. */
export async function call(base, method, path, body, headers = {}) {
  const response = await fetch(base + path, {
    method,
    headers: body === undefined ? headers : { "Content-Type": "application/json", ...headers },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

/** An SSE stream read frame by frame: `await events.next()` is {id, event, data} or null
 * at its end; `events.close()` ends it. Comment lines (keep-alives) are skipped. */
export async function openEvents(base, path, headers = {}) {
  const controller = new AbortController();
  const response = await fetch(base + path, { headers, signal: controller.signal });
  if (!response.headers.get("content-type")?.startsWith("text/event-stream")) {
    throw new Error(`${path}: ${response.status} ${await response.text()}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  return {
    async next() {
      for (;;) {
        const end = buffer.indexOf("\n\n");
        if (end >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const frame = {};
          for (const line of block.split("\n")) {
            if (line.startsWith(":")) continue;
            const colon = line.indexOf(":");
            const name = line.slice(0, colon);
            const value = line.slice(colon + 1).replace(/^ /, "");
            frame[name] = name === "data" ? JSON.parse(value) : value;
          }
          if ("data" in frame) return frame;
          continue;
        }
        const { done, value } = await reader.read();
        if (done) return null;
        buffer += decoder.decode(value, { stream: true });
      }
    },
    close() { controller.abort(); },
  };
}

/** Stop every started command still running: SIGTERM (the bridge then ends its
 * app-servers), SIGKILL after 10 s; resolves once each has exited. */
export async function killAll() {
  await Promise.all([...started].map((child) => {
    const gone = once(child, "exit");
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
    return gone.finally(() => clearTimeout(timer));
  }));
}
