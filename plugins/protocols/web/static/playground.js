// The chat playground: streams replies from the server's own OpenAI route (/v1/chat/completions),
// shows reasoning and tool calls apart from the answer, and times each reply. Plain JS, no build.
(function () {
  "use strict";
  var root = document.querySelector('meta[name="llmserve-root"]').content;
  var $ = function (id) { return document.getElementById(id); };
  var KEY_STORE = "llmserve.apiKey";  // also read by /docs, so "Try it out" carries the same key
  var history = [];     // the conversation sent with each request (the system prompt is added then)
  var modelId = null;
  var controller = null;

  var EXAMPLE_TOOLS = [{
    type: "function",
    "function": {
      name: "get_weather",
      description: "Current weather of a city",
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] }
    }
  }];

  // -- the API key: typed once, kept in this browser ----------------------------------------------
  function apiKey() { return $("api-key").value.trim(); }
  function headers(json) {
    var h = {};
    if (json) { h["Content-Type"] = "application/json"; }
    if (apiKey()) { h.Authorization = "Bearer " + apiKey(); }
    return h;
  }
  try { $("api-key").value = window.localStorage.getItem(KEY_STORE) || ""; } catch (e) { /* storage disabled */ }
  $("api-key").addEventListener("change", function () {
    try { window.localStorage.setItem(KEY_STORE, apiKey()); } catch (e) { /* storage disabled */ }
    metricsRefused = false;
    loadModel();
    loadMetrics();
  });

  function showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  // Answers the server refused, in words: the OpenAI error envelope's message when there is one.
  function refusal(response) {
    return response.text().then(function (body) {
      var message = body;
      try { message = JSON.parse(body).error.message || body; } catch (e) { /* not JSON */ }
      if (response.status === 401) {
        message = "The server needs an API key (it runs with --api-key): type it in the API key box. (" + message + ")";
      }
      return "HTTP " + response.status + ": " + message;
    });
  }

  // -- the served model and a glance at /metrics ----------------------------------------------------
  function loadModel() {
    fetch(root + "/v1/models", { headers: headers(false) }).then(function (r) {
      if (!r.ok) { $("model").textContent = r.status === 401 ? "model: API key needed" : "model: HTTP " + r.status; return; }
      return r.json().then(function (body) {
        modelId = body.data && body.data.length ? body.data[0].id : null;
        $("model").textContent = "model: " + (modelId || "none");
        // Images only for a model that reads them (its card's input_modalities say "image").
        var arch = body.data && body.data.length ? body.data[0].architecture : null;
        readsImages = !!(arch && (arch.input_modalities || []).indexOf("image") >= 0);
        $("attach").hidden = !readsImages;
      });
    }).catch(function () { $("model").textContent = "model: unreachable"; });
  }

  function parseMetrics(text) {
    var values = {};
    text.split("\n").forEach(function (line) {
      if (!line || line.charAt(0) === "#") { return; }
      var m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
      if (m) { values[m[1]] = (values[m[1]] || 0) + parseFloat(m[3]); }
    });
    return values;
  }

  var metricsRefused = false;  // no polling with a key the server refuses: asked again when the key changes
  function loadMetrics() {
    if (metricsRefused) { return; }
    fetch(root + "/metrics", { headers: headers(false) }).then(function (r) {
      if (!r.ok) {
        metricsRefused = r.status === 401;
        $("metrics").textContent = "metrics: " + (metricsRefused ? "API key needed" : "HTTP " + r.status);
        return;
      }
      return r.text().then(function (text) {
        var v = parseMetrics(text);
        var parts = [
          "running " + (v["vllm:num_requests_running"] || 0),
          "waiting " + (v["vllm:num_requests_waiting"] || 0),
          "KV cache " + ((v["vllm:kv_cache_usage_perc"] || 0) * 100).toFixed(1) + "%",
          "requests " + (v["vllm:request_success_total"] || 0),
          "tokens generated " + (v["vllm:generation_tokens_total"] || 0)
        ];
        $("metrics").textContent = parts.join(" · ");
      });
    }).catch(function () { $("metrics").textContent = "metrics: unreachable"; });
  }

  // -- settings -------------------------------------------------------------------------------------
  function pair(numberId, rangeId) {
    $(rangeId).addEventListener("input", function () { $(numberId).value = $(rangeId).value; });
    $(numberId).addEventListener("input", function () { $(rangeId).value = $(numberId).value; });
  }
  pair("temperature", "temperature-range");
  pair("top-p", "top-p-range");

  function parsedTools() {
    var text = $("tools").value.trim();
    if (!text) { return null; }
    var tools = JSON.parse(text);
    if (!Array.isArray(tools)) { throw new Error("the tools box must hold a JSON array of tools"); }
    return tools;
  }

  // tool_choice offers auto / required / none and each function of the tools box by name.
  function refreshChoices() {
    var select = $("tool-choice");
    var chosen = select.value;
    var names = [];
    try { (parsedTools() || []).forEach(function (t) { if (t["function"] && t["function"].name) { names.push(t["function"].name); } }); } catch (e) { names = []; }
    Array.prototype.slice.call(select.options).forEach(function (o) { if (o.value.indexOf("fn:") === 0) { select.removeChild(o); } });
    names.forEach(function (name) {
      var option = document.createElement("option");
      option.value = "fn:" + name;
      option.textContent = "function " + name;
      select.appendChild(option);
    });
    select.value = Array.prototype.some.call(select.options, function (o) { return o.value === chosen; }) ? chosen : "auto";
  }
  $("tools").addEventListener("input", refreshChoices);
  $("tools-example").addEventListener("click", function () {
    $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
    refreshChoices();
  });

  function requestBody() {
    var messages = [];
    var system = $("system").value.trim();
    if (system) { messages.push({ role: "system", content: system }); }
    var body = {
      messages: messages.concat(history),
      stream: true,
      stream_options: { include_usage: true },
      temperature: parseFloat($("temperature").value),
      top_p: parseFloat($("top-p").value),
      max_tokens: parseInt($("max-tokens").value, 10)
    };
    if (modelId) { body.model = modelId; }
    var tools;
    try { tools = parsedTools(); } catch (e) { throw new Error("Tools: " + e.message); }
    if (tools) {
      body.tools = tools;
      var choice = $("tool-choice").value;
      body.tool_choice = choice.indexOf("fn:") === 0 ? { type: "function", "function": { name: choice.slice(3) } } : choice;
    }
    if ($("schema-on").checked) {
      var schema;
      try { schema = JSON.parse($("schema").value); } catch (e) { throw new Error("JSON schema: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: schema } };
    }
    return body;
  }

  // -- the conversation -----------------------------------------------------------------------------
  function element(tag, className, text) {
    var node = document.createElement(tag);
    if (className) { node.className = className; }
    if (text) { node.textContent = text; }
    return node;
  }

  // -- images attached to the next message (data: URLs, sent as image_url parts) --------------------
  var readsImages = false;
  var attachments = [];

  function showAttachments() {
    var box = $("attachments");
    box.textContent = "";
    box.hidden = !attachments.length;
    attachments.forEach(function (url, i) {
      var img = element("img", "thumb");
      img.src = url;
      img.alt = "attached image " + (i + 1) + " (click to remove)";
      img.title = "click to remove";
      img.addEventListener("click", function () { attachments.splice(i, 1); showAttachments(); });
      box.appendChild(img);
    });
  }

  function attach(files) {
    Array.prototype.forEach.call(files, function (file) {
      if (!/^image\//.test(file.type)) { return; }
      var reader = new FileReader();
      reader.onload = function () { attachments.push(reader.result); showAttachments(); };
      reader.readAsDataURL(file);
    });
  }

  function addMessage(role, text, images) {
    var hint = $("hint");
    if (hint) { hint.remove(); }
    var box = element("div", "msg " + role);
    box.appendChild(element("div", "role", role));
    (images || []).forEach(function (url) {
      var img = element("img", "thumb");
      img.src = url;
      img.alt = "image sent";
      box.appendChild(img);
    });
    var view = { box: box, reasoning: null, content: element("div", "content", text || ""), calls: {} };
    box.appendChild(view.content);
    $("transcript").appendChild(box);
    scroll();
    return view;
  }

  function scroll() { $("transcript").scrollTop = $("transcript").scrollHeight; }

  function addReasoning(view, text) {
    if (!view.reasoning) {
      var details = element("details", "reasoning");
      details.open = true;
      details.appendChild(element("summary", "", "Reasoning"));
      view.reasoning = element("div", "reasoning-text");
      details.appendChild(view.reasoning);
      view.box.insertBefore(details, view.content);
    }
    view.reasoning.textContent += text;
  }

  // Tool-call deltas: the first names the call, later ones append argument text at the same index.
  function addToolCall(view, delta) {
    var index = delta.index === undefined ? 0 : delta.index;
    var call = view.calls[index];
    if (!call) {
      var node = element("div", "tool-call");
      call = view.calls[index] = { id: delta.id, name: "", args: "", nameNode: element("span", "tool-name"), argsNode: element("pre", "tool-args") };
      node.appendChild(call.nameNode);
      node.appendChild(call.argsNode);
      view.box.insertBefore(node, view.stats || null);
    }
    var fn = delta["function"] || {};
    if (delta.id) { call.id = delta.id; }
    if (fn.name) { call.name += fn.name; call.nameNode.textContent = call.name; }
    if (fn.arguments) { call.args += fn.arguments; call.argsNode.textContent = call.args; }
  }

  function finishCalls(view) {
    return Object.keys(view.calls).map(function (i) {
      var call = view.calls[i];
      try { call.argsNode.textContent = JSON.stringify(JSON.parse(call.args), null, 2); } catch (e) { /* as sent */ }
      return { id: call.id, type: "function", "function": { name: call.name, arguments: call.args } };
    });
  }

  function showStats(view, t) {
    var parts = [];
    if (t.first !== null) { parts.push("TTFT " + ((t.first - t.sent) / 1000).toFixed(2) + " s"); }
    var tokens = t.usage ? t.usage.completion_tokens : t.chunks;
    var seconds = t.first !== null ? (t.end - t.first) / 1000 : 0;
    if (tokens > 1 && seconds > 0) { parts.push(((tokens - 1) / seconds).toFixed(1) + " tokens/s"); }
    parts.push(tokens + " tokens");
    if (t.finish) { parts.push("finish: " + t.finish); }
    view.stats = element("div", "stats", parts.join(" · "));
    view.box.appendChild(view.stats);
    scroll();
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").hidden = !on;
  }

  // One streamed reply: Server-Sent Events read from the response body as they arrive.
  function send(text) {
    showError("");
    var body;
    var images = attachments;
    var parts = images.map(function (url) { return { type: "image_url", image_url: { url: url } }; });
    history.push({ role: "user", content: images.length ? parts.concat([{ type: "text", text: text }]) : text });
    try { body = requestBody(); } catch (e) { history.pop(); showError(e.message); return; }
    attachments = [];
    showAttachments();
    var question = addMessage("user", text, images);
    var view = addMessage("assistant", "");
    var t = { sent: performance.now(), first: null, end: null, chunks: 0, usage: null, finish: null };
    var content = "";
    controller = new AbortController();
    busy(true);

    function onEvent(data) {
      if (data === "[DONE]") { return; }
      var chunk = JSON.parse(data);
      if (chunk.error) { throw new Error(chunk.error.message || JSON.stringify(chunk.error)); }
      if (chunk.usage) { t.usage = chunk.usage; }
      (chunk.choices || []).forEach(function (choice) {
        var delta = choice.delta || {};
        var reasoning = delta.reasoning_content || delta.reasoning;
        if ((reasoning || delta.content || delta.tool_calls) && t.first === null) { t.first = performance.now(); }
        if (reasoning || delta.content || delta.tool_calls) { t.chunks += 1; }
        if (reasoning) { addReasoning(view, reasoning); }
        if (delta.content) { content += delta.content; view.content.textContent = content; }
        (delta.tool_calls || []).forEach(function (call) { addToolCall(view, call); });
        if (choice.finish_reason) { t.finish = choice.finish_reason; }
      });
      scroll();
    }

    fetch(root + "/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal })
      .then(function (response) {
        if (!response.ok) { return refusal(response).then(function (message) { throw new Error(message); }); }
        var reader = response.body.getReader();
        var decoder = new TextDecoder();
        var buffer = "";
        function pump() {
          return reader.read().then(function (step) {
            if (step.done) { return; }
            buffer += decoder.decode(step.value, { stream: true });
            var events = buffer.split(/\r?\n\r?\n/);
            buffer = events.pop();
            events.forEach(function (event) {
              event.split(/\r?\n/).forEach(function (line) {
                if (line.indexOf("data:") === 0) { onEvent(line.slice(5).trim()); }
              });
            });
            return pump();
          });
        }
        return pump();
      })
      .then(function () {
        t.end = performance.now();
        var calls = finishCalls(view);
        if (body.response_format) {
          try { view.content.textContent = JSON.stringify(JSON.parse(content), null, 2); view.content.classList.add("json"); } catch (e) { /* as sent */ }
        }
        var reply = { role: "assistant", content: content || (calls.length ? null : "") };
        if (calls.length) { reply.tool_calls = calls; }
        history.push(reply);
        showStats(view, t);
      })
      .catch(function (err) {
        t.end = performance.now();
        if (controller && err.name !== "AbortError") { controller.abort(); }  // a broken stream is not read on
        if (err.name === "AbortError") { showStats(view, Object.assign(t, { finish: "stopped" })); history.push({ role: "assistant", content: content }); return; }
        history.pop();  // the turn failed: it leaves the conversation, its text goes back to the box
        view.box.remove();
        question.box.remove();
        if (!$("prompt").value) { $("prompt").value = text; }
        if (!attachments.length) { attachments = images; showAttachments(); }
        showError(err.message);
        if (/API key/.test(err.message)) { $("api-key").focus(); }
      })
      .then(function () { busy(false); controller = null; loadMetrics(); });
  }

  $("composer").addEventListener("submit", function (event) {
    event.preventDefault();
    var text = $("prompt").value.trim();
    if (!text || controller) { return; }
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", function (event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", function () { if (controller) { controller.abort(); } });
  $("attach").addEventListener("click", function () { $("image-file").click(); });
  $("image-file").addEventListener("change", function () { attach(this.files); this.value = ""; });
  $("prompt").addEventListener("paste", function (event) {
    var files = event.clipboardData ? event.clipboardData.files : null;
    if (readsImages && files && files.length) { attach(files); }
  });
  $("clear").addEventListener("click", function () {
    if (controller) { controller.abort(); }
    history = [];
    attachments = [];
    showAttachments();
    $("transcript").textContent = "";
    showError("");
  });

  loadModel();
  loadMetrics();
  window.setInterval(loadMetrics, 5000);
})();
