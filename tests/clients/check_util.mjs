// What the client checks (anthropic_sdk_check.mjs, openai_sdk_check.mjs, metrics_check.mjs) share:
// their arguments, check() and its failures, show(), expected errors, and the run with its report.

// [BASE_URL, API_KEY] from the command line; exits 2 with the usage of `script` without them.
export function serverArgs(script) {
  const [baseURL, apiKey] = process.argv.slice(2);
  if (!baseURL || !apiKey) {
    console.error(`usage: node ${script} BASE_URL API_KEY`);
    process.exit(2);
  }
  return [baseURL, apiKey];
}

export let passed = 0;
export const failures = [];
export const check = (cond, what) => {
  if (cond) passed += 1;
  else failures.push(what);
};
export const show = (v) => JSON.stringify(v).slice(0, 400);

// Runs `fn`, which must throw an instance of `cls`; returns the error (null when there was none).
export async function expectError(what, cls, fn) {
  try {
    await fn();
    failures.push(`${what}: no error`);
  } catch (e) {
    check(e instanceof cls, `${what}: ${e?.constructor?.name} is not ${cls.name}: ${e?.message}`);
    return e;
  }
  return null;
}

// Runs `main`, prints the failures and the counts, and exits non-zero on any failure.
export async function runChecks(name, main) {
  try {
    await main();
  } catch (e) {
    failures.push(`unexpected error: ${e?.constructor?.name}: ${e?.message}\n${e?.stack}`);
  }
  for (const f of failures) console.log(`FAIL ${f}`);
  console.log(`${name}: ${passed} passed, ${failures.length} failed`);
  process.exit(failures.length ? 1 : 0);
}
